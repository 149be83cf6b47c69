//! The processor side of vision-language models, per family: the image processor's defaults
//! (over which `preprocessor_config.json` is read), the placeholder a prompt carries per image
//! and its expansion into the run of image tokens the model fills — in text, as the HF
//! processor expands it before tokenising, or in ids for callers that bring token ids.
//!
//! | family | image processor (PIL backend) | placeholder | expansion |
//! |---|---|---|---|
//! | Gemma 3 | `Gemma3ImageProcessor`: 224×224 exact resize, bilinear, rescale 1/255, mean = std = 0.5 | `<start_of_image>` (`boi_token_index`) | `\n\n<start_of_image>` + `<image_soft_token>` × `mm_tokens_per_image` + `<end_of_image>\n\n` |
//! | LLaVA | `CLIPImageProcessor`: shortest edge 224, bicubic, center crop 224, rescale 1/255, CLIP mean/std | `<image>` (`image_token_index`) | `<image>` × patches (+1 under `full`) |

use mlxcel_arch::vision::ImageInput;
use mlxcel_arch::ModelType;
use serde_json::Value;

use crate::image::{ImageProcessor, PixelValues, Resample, ResizeTarget, RgbImage};
use crate::tokenizer::Tokenizer;
use crate::{LoadError, Result};

/// One image as its family's processor prepares it for a prompt: the model inputs it becomes
/// and what replaces its placeholder. Families whose image-token count depends on the image
/// (tiles, crops, dynamic resolution) give each image its own expansion; the others share a
/// fixed one.
#[derive(Debug, Clone)]
pub struct PreparedImage {
    /// The model inputs, in prompt order (one per tile or crop; one for single-tile families).
    pub inputs: Vec<ImageInput>,
    /// What replaces this image's placeholder in the prompt text.
    pub expansion_text: String,
    /// The same, as ids.
    pub expansion_ids: Vec<u32>,
}

/// How one family's processor prepares images and expands prompts.
#[derive(Debug, Clone)]
pub struct VisionProcessor {
    /// The family (a family whose expansion depends on the image computes it in
    /// [`VisionProcessor::prepare_for_prompt`] by this).
    pub family: ModelType,
    /// The image processor (the checkpoint's config over the family's defaults).
    pub image: ImageProcessor,
    /// The token a prompt holds once per image before expansion.
    pub placeholder_id: u32,
    /// Its text.
    pub placeholder: String,
    /// What replaces each placeholder, as text (the processor's expansion).
    pub expansion_text: String,
    /// The same expansion as ids (tokenised piece by piece).
    pub expansion_ids: Vec<u32>,
    /// Why images cannot be prepared as the checkpoint's processor would (a processor option
    /// this build lacks), refused at [`VisionProcessor::prepare`] instead of computed otherwise.
    pub unsupported: Option<String>,
    /// Pad each image to a square of this colour (centred) before resizing:
    /// `LlavaImageProcessor`'s `do_pad`, the colour `int(mean · 255)` per channel.
    pub square_pad: Option<[u8; 3]>,
}

fn config_id(config: &Value, keys: &[&str], default: u32) -> u32 {
    keys.iter()
        .find_map(|k| config.get(*k).and_then(Value::as_u64))
        .map(|v| v as u32)
        .unwrap_or(default)
}

fn token_text(tokenizer: &Tokenizer, id: u32, what: &str) -> Result<String> {
    tokenizer.id_to_token(id).ok_or_else(|| {
        LoadError::Unsupported(format!(
            "the tokenizer has no token {id} ({what}) that the vision-language config names"
        ))
    })
}

impl VisionProcessor {
    /// The processor of `model_type` for the checkpoint in `folder`; `None` for types without
    /// a vision side.
    pub fn load(
        model_type: ModelType,
        folder: &std::path::Path,
        config: &Value,
        tokenizer: &Tokenizer,
    ) -> Result<Option<VisionProcessor>> {
        match model_type {
            ModelType::Gemma3 => {
                let defaults = ImageProcessor {
                    do_resize: true,
                    size: ResizeTarget::Exact {
                        height: 224,
                        width: 224,
                    },
                    resample: Resample::Bilinear,
                    center_crop: None,
                    rescale: Some(1.0 / 255.0),
                    normalize: Some(([0.5; 3], [0.5; 3])),
                };
                let image = ImageProcessor::load(folder, &defaults)?.unwrap_or(defaults);
                // Pan and scan adds crops per image, each its own image-token run.
                let unsupported = crate::image::processor_json(folder)?.and_then(|(json, file)| {
                    (json.get("do_pan_and_scan").and_then(Value::as_bool) == Some(true)).then(|| {
                        format!("{file}: do_pan_and_scan = true (Gemma 3's pan-and-scan crops) is not supported yet")
                    })
                });
                let boi = config_id(config, &["boi_token_index", "boi_token_id"], 255_999);
                let eoi = config_id(config, &["eoi_token_index", "eoi_token_id"], 256_000);
                let img = config_id(config, &["image_token_index", "image_token_id"], 262_144);
                let mm = config
                    .get("mm_tokens_per_image")
                    .and_then(Value::as_u64)
                    .unwrap_or(256) as usize;
                let (boi_t, eoi_t, img_t) = (
                    token_text(tokenizer, boi, "boi_token_index")?,
                    token_text(tokenizer, eoi, "eoi_token_index")?,
                    token_text(tokenizer, img, "image_token_index")?,
                );
                let expansion_text = format!("\n\n{boi_t}{}{eoi_t}\n\n", img_t.repeat(mm));
                let newlines = tokenizer.encode("\n\n", false)?;
                let mut expansion_ids = newlines.clone();
                expansion_ids.push(boi);
                expansion_ids.extend(std::iter::repeat_n(img, mm));
                expansion_ids.push(eoi);
                expansion_ids.extend(&newlines);
                Ok(Some(VisionProcessor {
                    family: model_type,
                    image,
                    placeholder_id: boi,
                    placeholder: boi_t,
                    expansion_text,
                    expansion_ids,
                    unsupported,
                    square_pad: None,
                }))
            }
            ModelType::Llava => {
                // CLIPImageProcessor's defaults.
                let defaults = ImageProcessor {
                    do_resize: true,
                    size: ResizeTarget::ShortestEdge(224),
                    resample: Resample::Bicubic,
                    center_crop: Some((224, 224)),
                    rescale: Some(1.0 / 255.0),
                    normalize: Some((
                        [0.48145466, 0.4578275, 0.40821073],
                        [0.26862954, 0.26130258, 0.27577711],
                    )),
                };
                let image = ImageProcessor::load(folder, &defaults)?.unwrap_or(defaults);
                // LlavaImageProcessor (not CLIPImageProcessor) may pad to a square first.
                let square_pad = crate::image::processor_json(folder)?.and_then(|(json, _)| {
                    let llava = json.get("image_processor_type").and_then(Value::as_str)
                        == Some("LlavaImageProcessor");
                    (llava && json.get("do_pad").and_then(Value::as_bool) == Some(true)).then(
                        || {
                            let mean = image.normalize.map_or([0.0; 3], |(m, _)| m);
                            mean.map(|m| (m * 255.0) as u8)
                        },
                    )
                });
                let id = config_id(config, &["image_token_index", "image_token_id"], 32000);
                let text = token_text(tokenizer, id, "image_token_index")?;
                // LlavaProcessor: the placeholder repeated once per image position (patches,
                // plus the class position under the `full` strategy).
                let vision = config.get("vision_config");
                let dim = |k: &str, d: u64| {
                    vision
                        .and_then(|v| v.get(k))
                        .and_then(Value::as_u64)
                        .unwrap_or(d) as usize
                };
                let side = dim("image_size", 224) / dim("patch_size", 32).max(1);
                let full = config
                    .get("vision_feature_select_strategy")
                    .and_then(Value::as_str)
                    == Some("full");
                let n = side * side + usize::from(full);
                Ok(Some(VisionProcessor {
                    family: model_type,
                    image,
                    placeholder_id: id,
                    expansion_text: text.repeat(n),
                    placeholder: text,
                    expansion_ids: vec![id; n],
                    unsupported: None,
                    square_pad,
                }))
            }
            _ => Ok(None),
        }
    }

    /// Pixel values of `image` as the HF processor computes them, with their content hash.
    pub fn prepare(&self, image: &RgbImage) -> Result<ImageInput> {
        if let Some(why) = &self.unsupported {
            return Err(LoadError::Unsupported(why.clone()));
        }
        let padded;
        let image = match self.square_pad {
            Some(colour) => {
                padded = crate::image::pad_to_square(image, colour);
                &padded
            }
            None => image,
        };
        let PixelValues {
            height,
            width,
            data,
        } = self.image.preprocess(image);
        let hash = PixelValues {
            height,
            width,
            data: data.clone(),
        }
        .content_hash();
        ImageInput::new(data, [1, 3, height, width], hash).map_err(LoadError::from)
    }

    /// `image` prepared for a prompt: its inputs and its expansion ([`PreparedImage`]). Gemma 3
    /// and LLaVA: one input and the family's fixed expansion; a family whose inputs or
    /// expansion depend on the image adds its arm here (by [`VisionProcessor::family`]).
    pub fn prepare_for_prompt(&self, image: &RgbImage) -> Result<PreparedImage> {
        Ok(PreparedImage {
            inputs: vec![self.prepare(image)?],
            expansion_text: self.expansion_text.clone(),
            expansion_ids: self.expansion_ids.clone(),
        })
    }

    /// `text` with its `k`-th placeholder replaced by `images[k]`'s expansion; the error says
    /// how many placeholders were found when they are not one per image.
    pub fn expand_text_for(&self, text: &str, images: &[PreparedImage]) -> Result<String> {
        let pieces: Vec<&str> = text.split(self.placeholder.as_str()).collect();
        if pieces.len() != images.len() + 1 {
            return Err(LoadError::Unsupported(format!(
                "the prompt has {} image placeholder(s) `{}` for {} image(s)",
                pieces.len() - 1,
                self.placeholder,
                images.len()
            )));
        }
        let mut out = String::from(pieces[0]);
        for (piece, image) in pieces[1..].iter().zip(images) {
            out.push_str(&image.expansion_text);
            out.push_str(piece);
        }
        Ok(out)
    }

    /// `ids` with the `k`-th placeholder id replaced by `images[k]`'s expansion ids.
    pub fn expand_ids_for(&self, ids: &[u32], images: &[PreparedImage]) -> Result<Vec<u32>> {
        let found = ids.iter().filter(|t| **t == self.placeholder_id).count();
        if found != images.len() {
            return Err(LoadError::Unsupported(format!(
                "the prompt ids hold the image token {} {found} time(s) for {} image(s)",
                self.placeholder_id,
                images.len()
            )));
        }
        let mut next = images.iter();
        let mut out = Vec::with_capacity(ids.len());
        for &t in ids {
            match (t == self.placeholder_id).then(|| next.next()).flatten() {
                Some(image) => out.extend(&image.expansion_ids),
                None => out.push(t),
            }
        }
        Ok(out)
    }

    /// `text` with each placeholder replaced by the expansion; the error says how many
    /// placeholders were found when they are not `images`.
    pub fn expand_text(&self, text: &str, images: usize) -> Result<String> {
        let found = text.matches(self.placeholder.as_str()).count();
        if found != images {
            return Err(LoadError::Unsupported(format!(
                "the prompt has {found} image placeholder(s) `{}` for {images} image(s)",
                self.placeholder
            )));
        }
        Ok(text.replace(self.placeholder.as_str(), &self.expansion_text))
    }

    /// `ids` with each placeholder id replaced by the expansion ids.
    pub fn expand_ids(&self, ids: &[u32], images: usize) -> Result<Vec<u32>> {
        let found = ids.iter().filter(|t| **t == self.placeholder_id).count();
        if found != images {
            return Err(LoadError::Unsupported(format!(
                "the prompt ids hold the image token {} {found} time(s) for {images} image(s)",
                self.placeholder_id
            )));
        }
        let mut out = Vec::with_capacity(ids.len() + images * self.expansion_ids.len());
        for &t in ids {
            if t == self.placeholder_id {
                out.extend(&self.expansion_ids);
            } else {
                out.push(t);
            }
        }
        Ok(out)
    }
}

//! The processor side of vision-language models, per family: the image processor's defaults
//! (over which `preprocessor_config.json` is read), the placeholder a prompt carries per image
//! and its expansion into the run of image tokens the model fills — in text, as the HF
//! processor expands it before tokenising, or in ids for callers that bring token ids.
//!
//! | family | image processor (PIL backend) | placeholder | expansion |
//! |---|---|---|---|
//! | Gemma 3 | `Gemma3ImageProcessor`: 224×224 exact resize, bilinear, rescale 1/255, mean = std = 0.5 | `<start_of_image>` (`boi_token_index`) | `\n\n<start_of_image>` + `<image_soft_token>` × `mm_tokens_per_image` + `<end_of_image>\n\n` |
//! | LLaVA | `CLIPImageProcessor`: shortest edge 224, bicubic, center crop 224, rescale 1/255, CLIP mean/std | `<image>` (`image_token_index`) | `<image>` × patches (+1 under `full`) |
//! | Qwen2-VL, Qwen2.5-VL | `Qwen2VLImageProcessor`: `smart_resize` to multiples of `patch_size · merge_size` within `[min_pixels, max_pixels]`, bicubic, rescale 1/255, CLIP mean/std | `<\|image_pad\|>` (`image_token_id`; a user message's image is `<\|vision_start\|><\|image_pad\|><\|vision_end\|>`) | `<\|image_pad\|>` × (that image's `grid_h · grid_w / merge_size²`) |

use mlxcel_arch::vision::qwen2_vl::smart_resize;
use mlxcel_arch::vision::ImageInput;
use mlxcel_arch::ModelType;
use serde_json::Value;

use crate::image::{
    resize, to_pixel_values, ImageProcessor, PixelValues, Resample, ResizeTarget, RgbImage,
};
use crate::tokenizer::Tokenizer;
use crate::{LoadError, Result};

/// How one family's processor prepares images and expands prompts.
#[derive(Debug, Clone)]
pub struct VisionProcessor {
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
    /// What a user message holds per image before the chat template renders it (the
    /// placeholder, or Qwen's `<|vision_start|><|image_pad|><|vision_end|>`).
    pub content_placeholder: String,
    /// Qwen's dynamic resolution: the image is resized by `smart_resize`, and its placeholder
    /// repeated once per merged patch (instead of the fixed expansion).
    pub dynamic: Option<DynamicResolution>,
    /// Why images cannot be prepared as the checkpoint's processor would (a processor option
    /// this build lacks), refused at [`VisionProcessor::prepare`] instead of computed otherwise.
    pub unsupported: Option<String>,
}

/// The Qwen2-VL processor's size rule: `smart_resize` (transformers) to sides that are
/// multiples of `patch · merge` with a pixel count in `[min_pixels, max_pixels]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DynamicResolution {
    /// `patch_size`.
    pub patch: usize,
    /// `merge_size`.
    pub merge: usize,
    /// `min_pixels` (else `size.shortest_edge`, default 56·56).
    pub min_pixels: usize,
    /// `max_pixels` (else `size.longest_edge`, default 28·28·1280).
    pub max_pixels: usize,
}

impl DynamicResolution {
    /// Image tokens of an image whose pixel values are `height × width`.
    fn tokens(&self, height: usize, width: usize) -> usize {
        (height / self.patch) * (width / self.patch) / (self.merge * self.merge)
    }
}

/// The Qwen2-VL image processor of a model folder: `preprocessor_config.json` (or
/// `processor_config.json`'s `image_processor`) over `Qwen2VLImageProcessor`'s defaults;
/// `min_pixels`/`max_pixels` win over `size`'s `shortest_edge`/`longest_edge` as in its
/// constructor.
fn qwen_image_processor(folder: &std::path::Path) -> Result<(ImageProcessor, DynamicResolution)> {
    let defaults = ImageProcessor {
        do_resize: true,
        // Replaced per image by `smart_resize` (see `VisionProcessor::prepare`).
        size: ResizeTarget::Exact {
            height: 0,
            width: 0,
        },
        resample: Resample::Bicubic,
        center_crop: None,
        rescale: Some(1.0 / 255.0),
        normalize: Some((
            [0.48145466, 0.4578275, 0.40821073],
            [0.26862954, 0.26130258, 0.27577711],
        )),
    };
    let (mut raw, file) = crate::image::processor_json(folder)?.unwrap_or_else(|| {
        (
            Value::Object(Default::default()),
            "preprocessor_config.json".into(),
        )
    });
    let num = |keys: &[(&str, Option<&str>)], default: usize| -> usize {
        keys.iter()
            .find_map(|(k, inner)| {
                let v = raw.get(*k)?;
                match inner {
                    Some(i) => v.get(*i)?.as_u64(),
                    None => v.as_u64(),
                }
            })
            .map(|v| v as usize)
            .unwrap_or(default)
    };
    let dynamic = DynamicResolution {
        patch: num(&[("patch_size", None)], 14),
        merge: num(&[("merge_size", None)], 2),
        min_pixels: num(
            &[("min_pixels", None), ("size", Some("shortest_edge"))],
            56 * 56,
        ),
        max_pixels: num(
            &[("max_pixels", None), ("size", Some("longest_edge"))],
            28 * 28 * 1280,
        ),
    };
    // `size` is Qwen's pixel bounds, not a shortest-edge resize: read the rest only.
    if let Value::Object(o) = &mut raw {
        o.remove("size");
    }
    let image = ImageProcessor::from_json(&raw, &defaults, &file)?;
    Ok((image, dynamic))
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
                    image,
                    placeholder_id: boi,
                    content_placeholder: boi_t.clone(),
                    placeholder: boi_t,
                    expansion_text,
                    expansion_ids,
                    dynamic: None,
                    unsupported,
                }))
            }
            ModelType::QwenVl => {
                let (image, dynamic) = qwen_image_processor(folder)?;
                let pad = config_id(config, &["image_token_id"], 151_655);
                let start = config_id(config, &["vision_start_token_id"], 151_652);
                let end = config_id(config, &["vision_end_token_id"], 151_653);
                let pad_t = token_text(tokenizer, pad, "image_token_id")?;
                let content_placeholder = format!(
                    "{}{pad_t}{}",
                    token_text(tokenizer, start, "vision_start_token_id")?,
                    token_text(tokenizer, end, "vision_end_token_id")?
                );
                Ok(Some(VisionProcessor {
                    image,
                    placeholder_id: pad,
                    placeholder: pad_t,
                    expansion_text: String::new(),
                    expansion_ids: Vec::new(),
                    content_placeholder,
                    dynamic: Some(dynamic),
                    unsupported: None,
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
                    image,
                    placeholder_id: id,
                    expansion_text: text.repeat(n),
                    content_placeholder: text.clone(),
                    placeholder: text,
                    expansion_ids: vec![id; n],
                    dynamic: None,
                    unsupported: None,
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
        let PixelValues {
            height,
            width,
            data,
        } = match &self.dynamic {
            None => self.image.preprocess(image),
            Some(d) => {
                let (h, w) = smart_resize(
                    image.height,
                    image.width,
                    d.patch * d.merge,
                    d.min_pixels,
                    d.max_pixels,
                )?;
                let resized = if self.image.do_resize {
                    resize(image, w, h, self.image.resample)
                } else {
                    image.clone()
                };
                to_pixel_values(&resized, self.image.rescale, self.image.normalize)
            }
        };
        let hash = PixelValues {
            height,
            width,
            data: data.clone(),
        }
        .content_hash();
        ImageInput::new(data, [1, 3, height, width], hash).map_err(LoadError::from)
    }

    /// How many image tokens each image's placeholder expands to (Qwen's dynamic resolution;
    /// `None` for a fixed expansion).
    fn dynamic_counts(&self, images: &[ImageInput]) -> Option<Vec<usize>> {
        self.dynamic.map(|d| {
            images
                .iter()
                .map(|i| d.tokens(i.shape()[2], i.shape()[3]))
                .collect()
        })
    }

    /// `text` with each placeholder replaced by the expansion (the `k`-th by the `k`-th
    /// image's under dynamic resolution); the error says how many placeholders were found when
    /// they are not one per image.
    pub fn expand_text(&self, text: &str, images: &[ImageInput]) -> Result<String> {
        let found = text.matches(self.placeholder.as_str()).count();
        if found != images.len() {
            return Err(LoadError::Unsupported(format!(
                "the prompt has {found} image placeholder(s) `{}` for {} image(s)",
                self.placeholder,
                images.len()
            )));
        }
        let Some(counts) = self.dynamic_counts(images) else {
            return Ok(text.replace(self.placeholder.as_str(), &self.expansion_text));
        };
        let mut pieces = text.split(self.placeholder.as_str());
        let mut out = pieces.next().unwrap_or_default().to_string();
        for (piece, n) in pieces.zip(counts) {
            out.push_str(&self.placeholder.repeat(n));
            out.push_str(piece);
        }
        Ok(out)
    }

    /// `ids` with each placeholder id replaced by the expansion ids (the `k`-th image's count
    /// of placeholders under dynamic resolution).
    pub fn expand_ids(&self, ids: &[u32], images: &[ImageInput]) -> Result<Vec<u32>> {
        let found = ids.iter().filter(|t| **t == self.placeholder_id).count();
        if found != images.len() {
            return Err(LoadError::Unsupported(format!(
                "the prompt ids hold the image token {} {found} time(s) for {} image(s)",
                self.placeholder_id,
                images.len()
            )));
        }
        let counts = self.dynamic_counts(images);
        let mut out = Vec::with_capacity(ids.len() + images.len() * self.expansion_ids.len());
        let mut k = 0;
        for &t in ids {
            if t != self.placeholder_id {
                out.push(t);
                continue;
            }
            match &counts {
                Some(c) => out.extend(std::iter::repeat_n(t, c[k])),
                None => out.extend(&self.expansion_ids),
            }
            k += 1;
        }
        Ok(out)
    }
}

//! The processor side of vision-language models, per family: the image processor's defaults
//! (over which `preprocessor_config.json` is read), the placeholder a prompt carries per image
//! and its expansion into the run of image tokens the model fills — in text, as the HF
//! processor expands it before tokenising, or in ids for callers that bring token ids (piece by
//! piece: exact where the expansion's pieces tokenise alone as in context, which holds for the
//! special-token runs; Gemma 3's pan-and-scan framing text may merge differently).
//!
//! | family | image processor (PIL backend) | placeholder | expansion |
//! |---|---|---|---|
//! | Gemma 3 | `Gemma3ImageProcessor`: 224×224 exact resize, bilinear, rescale 1/255, mean = std = 0.5; pan and scan (crops as extra inputs) | `<start_of_image>` (`boi_token_index`) | `\n\n<start_of_image>` + `<image_soft_token>` × `mm_tokens_per_image` + `<end_of_image>\n\n`; with crops `Here is the original image {seq} and here are some crops to help you see better {seq} {seq}` |
//! | LLaVA | `CLIPImageProcessor`: shortest edge 224, bicubic, center crop 224, rescale 1/255, CLIP mean/std | `<image>` (`image_token_index`) | `<image>` × patches (+1 under `full`) |
//! | Mistral 3 (Pixtral) | `PixtralImageProcessor`: both sides fit `size.longest_edge` (shrunk by the larger ratio, floored), then rounded up to multiples of `patch_size · spatial_merge_size`, bicubic, rescale 1/255, CLIP mean/std; no tiling | `[IMG]` (`image_token_index`) | per merged-patch row `[IMG]` × cols + `[IMG_BREAK]`, the last break `[IMG_END]` |
//! | Idefics3, SmolVLM | `Idefics3ImageProcessor`: longest edge to `size.longest_edge` (other side even), Lanczos; with `do_image_splitting` resized to multiples of `max_image_size.longest_edge` and cut into such tiles plus the whole image resized to one tile (the global image), else resized to one tile; rescale 1/255, mean = std = 0.5 | `<image>` (`image_token_id`) | per tile `<fake_token_around_image><row_r_col_c>` + `<image>` × `image_seq_len`, `\n` after each row, then `\n<fake_token_around_image><global-img>` + `<image>` × `image_seq_len` + `<fake_token_around_image>` (no tiles: the global part alone, without the leading `\n`) |
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

/// Gemma 3's pan-and-scan settings (the image processor's, else `Gemma3Processor`'s defaults
/// 256, 4, 1.2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PanAndScan {
    /// `pan_and_scan_min_crop_size`: no crop narrower than this.
    pub min_crop_size: usize,
    /// `pan_and_scan_max_num_crops`.
    pub max_num_crops: usize,
    /// `pan_and_scan_min_ratio_to_activate`: the aspect ratio from which crops are made.
    pub min_ratio: f64,
}

impl PanAndScan {
    /// The crops of `image` (transformers' `pan_and_scan`: 2 to `max_num_crops` along the
    /// longer side, none when the image is not elongated enough or a crop would be too small;
    /// the last crop cut at the border as numpy slicing does).
    pub fn crops(&self, image: &RgbImage) -> Vec<RgbImage> {
        let (h, w) = (image.height, image.width);
        let (nw, nh) = if w >= h {
            if (w as f64 / h as f64) < self.min_ratio {
                return Vec::new();
            }
            let n = ((w as f64 / h as f64 + 0.5).floor() as usize)
                .min((w as f64 / self.min_crop_size as f64).floor() as usize)
                .max(2)
                .min(self.max_num_crops);
            (n, 1)
        } else {
            if (h as f64 / w as f64) < self.min_ratio {
                return Vec::new();
            }
            let n = ((h as f64 / w as f64 + 0.5).floor() as usize)
                .min((h as f64 / self.min_crop_size as f64).floor() as usize)
                .max(2)
                .min(self.max_num_crops);
            (1, n)
        };
        let (cw, ch) = (w.div_ceil(nw), h.div_ceil(nh));
        if cw.min(ch) < self.min_crop_size {
            return Vec::new();
        }
        let mut out = Vec::new();
        for r in 0..nh {
            for c in 0..nw {
                let (y0, x0) = (r * ch, c * cw);
                let (y1, x1) = ((y0 + ch).min(h), (x0 + cw).min(w));
                let mut data = Vec::with_capacity((y1 - y0) * (x1 - x0) * 3);
                for y in y0..y1 {
                    data.extend_from_slice(&image.data[(y * w + x0) * 3..(y * w + x1) * 3]);
                }
                out.push(RgbImage {
                    width: x1 - x0,
                    height: y1 - y0,
                    data,
                });
            }
        }
        out
    }
}

/// transformers' `MAX_IMAGE_SIZE` for Idefics3: no resized side beyond this.
const IDEFICS3_MAX_IMAGE_SIZE: usize = 4096;

/// Idefics3 / SmolVLM's image processor settings and the pieces of its prompt expansion
/// (`Idefics3ImageProcessor` + `Idefics3Processor`, identical for SmolVLM).
#[derive(Debug, Clone, PartialEq)]
pub struct Idefics3Tiling {
    /// `size.longest_edge` when `do_resize` (default 4 · 364): the image's longer side is
    /// first resized to it, up or down.
    pub longest_edge: Option<usize>,
    /// `max_image_size.longest_edge` (default 364): the side of every tile.
    pub tile: usize,
    /// `do_image_splitting` (default true).
    pub split: bool,
    /// `<image>` positions per tile: the model's `(image_size / patch_size)² / scale_factor²`.
    pub image_seq_len: usize,
    /// `<fake_token_around_image>`, as text and id.
    pub fake: (String, u32),
    /// `<global-img>`, as text and its ids.
    pub global: (String, Vec<u32>),
    /// The ids of `<row_{r}_col_{c}>` for `r, c` in `1 ..= grid`, row-major (`grid` as large as
    /// the resize allows).
    pub row_col_ids: Vec<Vec<u32>>,
    /// Tiles per side the table covers.
    pub grid: usize,
    /// The ids of `"\n"` (after a row of tiles) and `"\n\n"` (after the last row, before the
    /// global image), each tokenised alone as it stands between special tokens.
    pub newline_ids: [Vec<u32>; 2],
}

/// `int(x)` of a positive double, as Python truncates it.
fn py_int(x: f64) -> usize {
    x.max(0.0) as usize
}

/// `_resize_output_size_rescale_to_max_len`: the longer side to `max_len` (up or down), the
/// other by the aspect ratio, truncated and then made even; sides at least 1.
fn idefics3_rescale_to_max_len(height: usize, width: usize, max_len: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    // The derived side is made even (rounded up).
    let even = |v: usize| v + v % 2;
    let (h, w) = if width >= height {
        (even(py_int(max_len as f64 / aspect)), max_len)
    } else {
        (max_len, even(py_int(max_len as f64 * aspect)))
    };
    (h.max(1), w.max(1))
}

/// `_resize_output_size_scale_below_upper_bound`: a longer side beyond `max_len` down to it.
fn idefics3_scale_below(height: usize, width: usize, max_len: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    let (mut h, mut w) = (height, width);
    if width >= height && width > max_len {
        w = max_len;
        h = py_int(w as f64 / aspect);
    } else if height > width && height > max_len {
        h = max_len;
        w = py_int(h as f64 * aspect);
    }
    (h.max(1), w.max(1))
}

/// `resize_for_vision_encoder`: the longer side up to a multiple of `tile`, the other from the
/// aspect ratio, then up to a multiple of `tile` too.
fn idefics3_tile_multiple(height: usize, width: usize, tile: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    if width >= height {
        let w = width.div_ceil(tile) * tile;
        let h = py_int(w as f64 / aspect).div_ceil(tile) * tile;
        (h, w)
    } else {
        let h = height.div_ceil(tile) * tile;
        let w = py_int(h as f64 * aspect).div_ceil(tile) * tile;
        (h, w)
    }
}

impl Idefics3Tiling {
    /// The 8-bit tiles of `image` in the processor's order (row-major tiles, then the global
    /// image; the global image alone when there are no tiles) and the tile grid `(rows,
    /// columns)`, `(0, 0)` without tiles. Every tile is `tile × tile`.
    pub fn tiles(&self, image: &RgbImage, resample: Resample) -> (Vec<RgbImage>, usize, usize) {
        let mut img = image.clone();
        if let Some(edge) = self.longest_edge {
            let (h, w) = idefics3_rescale_to_max_len(img.height, img.width, edge);
            let (h, w) = idefics3_scale_below(h, w, IDEFICS3_MAX_IMAGE_SIZE);
            img = resize(&img, w, h, resample);
        }
        let m = self.tile;
        if !self.split {
            return (vec![resize(&img, m, m, resample)], 0, 0);
        }
        let (h, w) = idefics3_tile_multiple(img.height, img.width, m);
        img = resize(&img, w, h, resample);
        if img.height <= m && img.width <= m {
            return (vec![img], 0, 0);
        }
        let (rows, cols) = ((img.height - m) / m + 1, (img.width - m) / m + 1);
        let mut out = Vec::with_capacity(rows * cols + 1);
        for r in 0..rows {
            for c in 0..cols {
                let mut data = Vec::with_capacity(m * m * 3);
                for y in r * m..(r + 1) * m {
                    let at = (y * img.width + c * m) * 3;
                    data.extend_from_slice(&img.data[at..at + m * 3]);
                }
                out.push(RgbImage {
                    width: m,
                    height: m,
                    data,
                });
            }
        }
        out.push(resize(&img, m, m, resample));
        (out, rows, cols)
    }

    /// The expansion of an image with a `rows × cols` tile grid, as text (over the image
    /// token's text `image`) and ids (over its id).
    fn expansion(
        &self,
        rows: usize,
        cols: usize,
        image: (&str, u32),
    ) -> Result<(String, Vec<u32>)> {
        let (fake_t, fake) = (&self.fake.0, self.fake.1);
        let run_t = image.0.repeat(self.image_seq_len);
        let run: Vec<u32> = vec![image.1; self.image_seq_len];
        let mut text = String::new();
        let mut ids = Vec::new();
        if rows > 0 || cols > 0 {
            if rows > self.grid || cols > self.grid {
                return Err(LoadError::Unsupported(format!(
                    "an image of {rows}x{cols} tiles: the processor's expansion table covers {0}x{0} (size.longest_edge / max_image_size.longest_edge)",
                    self.grid
                )));
            }
            for r in 0..rows {
                for c in 0..cols {
                    text.push_str(&format!("{fake_t}<row_{}_col_{}>{run_t}", r + 1, c + 1));
                    ids.push(fake);
                    ids.extend(&self.row_col_ids[r * self.grid + c]);
                    ids.extend(&run);
                }
                text.push('\n');
                if r + 1 < rows {
                    ids.extend(&self.newline_ids[0]);
                }
            }
            // The last row's "\n" and the global image's leading "\n" tokenise together.
            text.push('\n');
            ids.extend(&self.newline_ids[1]);
        }
        text.push_str(&format!("{fake_t}{}{run_t}{fake_t}", self.global.0));
        ids.push(fake);
        ids.extend(&self.global.1);
        ids.extend(&run);
        ids.push(fake);
        Ok((text, ids))
    }
}

/// The Idefics3 / SmolVLM processor of a model folder: `preprocessor_config.json` (or
/// `processor_config.json`'s `image_processor`) over `Idefics3ImageProcessor`'s defaults, the
/// special tokens from the tokenizer, `image_seq_len` from the model config.
fn idefics3_processor(
    model_type: ModelType,
    folder: &std::path::Path,
    config: &Value,
    tokenizer: &Tokenizer,
) -> Result<VisionProcessor> {
    let defaults = ImageProcessor {
        do_resize: true,
        // Replaced by the longest-edge rule (see `Idefics3Tiling::tiles`).
        size: ResizeTarget::Exact {
            height: 0,
            width: 0,
        },
        resample: Resample::Lanczos,
        center_crop: None,
        rescale: Some(1.0 / 255.0),
        normalize: Some(([0.5; 3], [0.5; 3])),
    };
    let (mut raw, file) = processor_json_or_empty(folder)?;
    let edge = |key: &str, default: usize| -> Result<usize> {
        match raw.get(key).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v
                .get("longest_edge")
                .and_then(Value::as_u64)
                .filter(|e| *e > 0)
                .map(|e| e as usize)
                .ok_or_else(|| {
                    LoadError::Unsupported(format!(
                        "{file}: `{key}` must have a positive `longest_edge` (Idefics3ImageProcessor)"
                    ))
                }),
        }
    };
    let longest = edge("size", 4 * 364)?;
    let tile = edge("max_image_size", 364)?;
    let split = match raw.get("do_image_splitting").filter(|v| !v.is_null()) {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| {
            LoadError::Unsupported(format!(
                "{file}: `do_image_splitting` must be true or false"
            ))
        })?,
    };
    // `size` is a longest edge here, which the shared reader does not take: read the rest.
    if let Value::Object(o) = &mut raw {
        o.remove("size");
    }
    let image = ImageProcessor::from_json(&raw, &defaults, &file)?;
    // The model's tile length (what the connector makes of one tile).
    let vision = config.get("vision_config");
    let dim = |k: &str, d: u64| {
        vision
            .and_then(|v| v.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(d) as usize
    };
    let scale = config
        .get("scale_factor")
        .and_then(Value::as_u64)
        .unwrap_or(2)
        .max(1) as usize;
    let side = dim("image_size", 224) / dim("patch_size", 32).max(1);
    let image_seq_len = side * side / (scale * scale);
    let id = config_id(config, &["image_token_id"], 128_257);
    let image_t = token_text(tokenizer, id, "image_token_id")?;
    let fake_t = "<fake_token_around_image>";
    let fake = tokenizer.token_to_id(fake_t).ok_or_else(|| {
        LoadError::Unsupported(format!(
            "the tokenizer has no `{fake_t}` token, which Idefics3's prompt expansion needs"
        ))
    })?;
    let global_t = "<global-img>";
    // Tiles per side the resize can make (no resize: up to transformers' MAX_IMAGE_SIZE).
    let grid = if image.do_resize {
        longest
    } else {
        IDEFICS3_MAX_IMAGE_SIZE
    }
    .div_ceil(tile)
    .max(1);
    let mut row_col_ids = Vec::with_capacity(grid * grid);
    for r in 1..=grid {
        for c in 1..=grid {
            row_col_ids.push(tokenizer.encode(&format!("<row_{r}_col_{c}>"), false)?);
        }
    }
    let tiling = Idefics3Tiling {
        longest_edge: image.do_resize.then_some(longest),
        tile,
        split,
        image_seq_len,
        fake: (fake_t.to_string(), fake),
        global: (global_t.to_string(), tokenizer.encode(global_t, false)?),
        row_col_ids,
        grid,
        newline_ids: [
            tokenizer.encode("\n", false)?,
            tokenizer.encode("\n\n", false)?,
        ],
    };
    Ok(VisionProcessor {
        family: model_type,
        image,
        placeholder_id: id,
        placeholder: image_t.clone(),
        // The expansion depends on the image's tile grid (see `prepare_for_prompt`).
        expansion_text: String::new(),
        expansion_ids: Vec::new(),
        content_placeholder: image_t,
        dynamic: None,
        pan_and_scan: None,
        framing_ids: Default::default(),
        square_pad: None,
        pixtral: None,
        tiling: Some(tiling),
    })
}

/// How one family's processor prepares images and expands prompts.
#[derive(Debug, Clone)]
pub struct VisionProcessor {
    /// The family this processor was loaded for (what varies per image is in the fields
    /// below: `dynamic`, `pan_and_scan`).
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
    /// What a user message holds per image before the chat template renders it (the
    /// placeholder, or Qwen's `<|vision_start|><|image_pad|><|vision_end|>`).
    pub content_placeholder: String,
    /// Qwen's dynamic resolution: the image is resized by `smart_resize`, and its placeholder
    /// repeated once per merged patch (instead of the fixed expansion).
    pub dynamic: Option<DynamicResolution>,
    /// Gemma 3's pan and scan (`do_pan_and_scan`): crops of a wide or tall image added as
    /// extra images, framed by text in the prompt.
    pub pan_and_scan: Option<PanAndScan>,
    /// The tokenised pieces of the pan-and-scan framing (`"Here is the original image "`,
    /// `" and here are some crops to help you see better "`, `" "`), for the ids path.
    pub framing_ids: [Vec<u32>; 3],
    /// Pad each image to a square of this colour (centred) before resizing:
    /// `LlavaImageProcessor`'s `do_pad`, the colour `int(mean · 255)` per channel.
    pub square_pad: Option<[u8; 3]>,
    /// Mistral 3's Pixtral processor: the image resized to fit `longest_edge` in multiples of
    /// the merged patch, and its placeholder expanded into rows with break markers.
    pub pixtral: Option<PixtralLayout>,
    /// Idefics3 / SmolVLM's image splitting and framed expansion (see [`Idefics3Tiling`]).
    pub tiling: Option<Idefics3Tiling>,
}

/// The Pixtral processor's resize and prompt expansion (`PixtralProcessor` with its
/// `PixtralImageProcessor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PixtralLayout {
    /// `patch_size · spatial_merge_size`: the sides are multiples of it, and each such square
    /// is one `[IMG]` token.
    pub unit: usize,
    /// `size.longest_edge` (or `size.height`, `size.width`): the bounds of the resize.
    pub max_height: usize,
    /// See `max_height`.
    pub max_width: usize,
    /// `[IMG_BREAK]`'s id and text.
    pub break_id: u32,
    /// Its text.
    pub break_text: String,
    /// `[IMG_END]`'s id.
    pub end_id: u32,
    /// Its text.
    pub end_text: String,
}

impl PixtralLayout {
    /// transformers' `get_resize_output_image_size` (Pixtral): shrink by the larger of the
    /// two ratios to the bounds (floored, never enlarged), then round each side up to a
    /// multiple of `unit`.
    pub fn output_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let ratio =
            (height as f64 / self.max_height as f64).max(width as f64 / self.max_width as f64);
        let (mut h, mut w) = (height, width);
        if ratio > 1.0 {
            h = (height as f64 / ratio).floor() as usize;
            w = (width as f64 / ratio).floor() as usize;
        }
        if h == 0 || w == 0 {
            return Err(LoadError::Unsupported(format!(
                "an image of {width}x{height} pixels shrinks to nothing within {}x{} (too elongated)",
                self.max_width, self.max_height
            )));
        }
        Ok((
            h.div_ceil(self.unit) * self.unit,
            w.div_ceil(self.unit) * self.unit,
        ))
    }
}

/// The mean and standard deviation CLIP's image processor normalises with (LLaVA, Qwen2-VL,
/// Pixtral).
const CLIP_MEAN_STD: ([f64; 3], [f64; 3]) = (
    [0.48145466, 0.4578275, 0.40821073],
    [0.26862954, 0.26130258, 0.27577711],
);

/// The defaults of processors that choose each image's size themselves (Qwen2-VL, Pixtral):
/// bicubic, rescale 1/255, CLIP normalisation; `size` is a placeholder the family replaces.
fn sized_per_image_defaults() -> ImageProcessor {
    ImageProcessor {
        do_resize: true,
        size: ResizeTarget::Exact {
            height: 0,
            width: 0,
        },
        resample: Resample::Bicubic,
        center_crop: None,
        rescale: Some(1.0 / 255.0),
        normalize: Some(CLIP_MEAN_STD),
    }
}

/// The folder's processor JSON and its file name, or an empty object (every field at the
/// family's default) named `preprocessor_config.json` when the folder has none.
fn processor_json_or_empty(folder: &std::path::Path) -> Result<(Value, String)> {
    Ok(crate::image::processor_json(folder)?.unwrap_or_else(|| {
        (
            Value::Object(Default::default()),
            "preprocessor_config.json".into(),
        )
    }))
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
    // The size is replaced per image by `smart_resize` (see `VisionProcessor::prepare_one`).
    let defaults = sized_per_image_defaults();
    let (mut raw, file) = processor_json_or_empty(folder)?;
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
            ModelType::Mistral3 => pixtral_processor(folder, config, tokenizer).map(Some),
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
                let pan_and_scan = crate::image::processor_json(folder)?.and_then(|(json, _)| {
                    let num = |k: &str, d: f64| json.get(k).and_then(Value::as_f64).unwrap_or(d);
                    (json.get("do_pan_and_scan").and_then(Value::as_bool) == Some(true)).then(
                        || PanAndScan {
                            min_crop_size: num("pan_and_scan_min_crop_size", 256.0) as usize,
                            max_num_crops: num("pan_and_scan_max_num_crops", 4.0) as usize,
                            min_ratio: num("pan_and_scan_min_ratio_to_activate", 1.2),
                        },
                    )
                });
                let framing_ids = [
                    tokenizer.encode("Here is the original image ", false)?,
                    tokenizer.encode(" and here are some crops to help you see better ", false)?,
                    tokenizer.encode(" ", false)?,
                ];
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
                    content_placeholder: boi_t.clone(),
                    placeholder: boi_t,
                    expansion_text,
                    expansion_ids,
                    dynamic: None,
                    pan_and_scan,
                    framing_ids,
                    square_pad: None,
                    pixtral: None,
                    tiling: None,
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
                // The expansion depends on the image (see `prepare_for_prompt`): no fixed one.
                Ok(Some(VisionProcessor {
                    family: model_type,
                    image,
                    placeholder_id: pad,
                    placeholder: pad_t,
                    expansion_text: String::new(),
                    expansion_ids: Vec::new(),
                    content_placeholder,
                    dynamic: Some(dynamic),
                    pan_and_scan: None,
                    framing_ids: Default::default(),
                    square_pad: None,
                    pixtral: None,
                    tiling: None,
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
                    normalize: Some(CLIP_MEAN_STD),
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
                    content_placeholder: text.clone(),
                    placeholder: text,
                    expansion_ids: vec![id; n],
                    dynamic: None,
                    pan_and_scan: None,
                    framing_ids: Default::default(),
                    square_pad,
                    pixtral: None,
                    tiling: None,
                }))
            }
            ModelType::Idefics3 => {
                idefics3_processor(model_type, folder, config, tokenizer).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Pixel values of `image` as the HF processor computes them, with their content hash.
    pub fn prepare(&self, image: &RgbImage) -> Result<ImageInput> {
        if self.tiling.is_some() {
            // One input when the processor makes one tile (no splitting, or a small image).
            let mut prepared = self.prepare_for_prompt(image)?;
            if prepared.inputs.len() != 1 {
                return Err(LoadError::Unsupported(format!(
                    "image splitting (do_image_splitting) makes {} inputs of this image: prepare images with `prepare_for_prompt`",
                    prepared.inputs.len()
                )));
            }
            return Ok(prepared.inputs.remove(0));
        }
        if self.pan_and_scan.is_some() {
            return Err(LoadError::Unsupported(
                "pan and scan (do_pan_and_scan) makes several inputs per image: prepare images with `prepare_for_prompt`".into(),
            ));
        }
        self.prepare_one(image)
    }

    /// One model input of `image` (padded, resized, rescaled, normalised), with its hash.
    fn prepare_one(&self, image: &RgbImage) -> Result<ImageInput> {
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
        } = match (&self.dynamic, &self.pixtral) {
            (None, Some(layout)) => {
                let (h, w) = layout.output_size(image.height, image.width)?;
                let resized = if self.image.do_resize {
                    resize(image, w, h, self.image.resample)
                } else {
                    image.clone()
                };
                to_pixel_values(&resized, self.image.rescale, self.image.normalize)
            }
            (None, None) => self.image.preprocess(image),
            (Some(d), _) => {
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

    /// `image` prepared for a prompt: its inputs and its expansion ([`PreparedImage`]). Gemma 3
    /// and LLaVA: one input and the family's fixed expansion (Gemma 3's pan and scan adds its
    /// crops, framed); Qwen2-VL: one input, resized by `smart_resize`, and its placeholder once
    /// per merged patch. A family whose inputs or expansion depend on the image adds its arm
    /// here.
    pub fn prepare_for_prompt(&self, image: &RgbImage) -> Result<PreparedImage> {
        if let Some(layout) = &self.pixtral {
            // PixtralProcessor: per row of merged patches `[IMG]` × cols then `[IMG_BREAK]`,
            // the last break replaced by `[IMG_END]`.
            let input = self.prepare_one(image)?;
            let [_, _, h, w] = input.shape();
            if h % layout.unit != 0 || w % layout.unit != 0 {
                return Err(LoadError::Unsupported(format!(
                    "image of {w}x{h} pixels after preprocessing: Pixtral needs sides that are multiples of {} (set do_resize)",
                    layout.unit
                )));
            }
            let (rows, cols) = (h / layout.unit, w / layout.unit);
            let mut text = String::new();
            let mut ids = Vec::with_capacity(rows * (cols + 1));
            for r in 0..rows {
                text.push_str(&self.placeholder.repeat(cols));
                ids.extend(std::iter::repeat_n(self.placeholder_id, cols));
                let last = r + 1 == rows;
                text.push_str(if last {
                    &layout.end_text
                } else {
                    &layout.break_text
                });
                ids.push(if last { layout.end_id } else { layout.break_id });
            }
            return Ok(PreparedImage {
                inputs: vec![input],
                expansion_text: text,
                expansion_ids: ids,
            });
        }
        if let Some(t) = &self.tiling {
            // Idefics3: the tiles (and global image) as separate inputs, each its own run.
            let (tiles, rows, cols) = t.tiles(image, self.image.resample);
            let inputs = tiles
                .iter()
                .map(|tile| {
                    let pv = to_pixel_values(tile, self.image.rescale, self.image.normalize);
                    let hash = pv.content_hash();
                    ImageInput::new(pv.data, [1, 3, pv.height, pv.width], hash)
                        .map_err(LoadError::from)
                })
                .collect::<Result<Vec<_>>>()?;
            let (expansion_text, expansion_ids) =
                t.expansion(rows, cols, (&self.placeholder, self.placeholder_id))?;
            return Ok(PreparedImage {
                inputs,
                expansion_text,
                expansion_ids,
            });
        }
        if let Some(d) = &self.dynamic {
            let input = self.prepare_one(image)?;
            let n = d.tokens(input.shape()[2], input.shape()[3]);
            return Ok(PreparedImage {
                inputs: vec![input],
                expansion_text: self.placeholder.repeat(n),
                expansion_ids: vec![self.placeholder_id; n],
            });
        }
        if let Some(pas) = self.pan_and_scan {
            let crops = pas.crops(image);
            if !crops.is_empty() {
                // Gemma3Processor: "Here is the original image {seq} and here are some crops
                // to help you see better {seq} {seq}".
                let mut inputs = vec![self.prepare_one(image)?];
                for c in &crops {
                    inputs.push(self.prepare_one(c)?);
                }
                let seqs = vec![self.expansion_text.as_str(); crops.len()].join(" ");
                let [original, crops_intro, space] = &self.framing_ids;
                let mut ids = original.clone();
                ids.extend(&self.expansion_ids);
                ids.extend(crops_intro);
                for i in 0..crops.len() {
                    if i > 0 {
                        ids.extend(space);
                    }
                    ids.extend(&self.expansion_ids);
                }
                return Ok(PreparedImage {
                    inputs,
                    expansion_text: format!(
                        "Here is the original image {} and here are some crops to help you see better {seqs}",
                        self.expansion_text
                    ),
                    expansion_ids: ids,
                });
            }
        }
        Ok(PreparedImage {
            inputs: vec![self.prepare_one(image)?],
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
}

/// Mistral 3's processor (`PixtralProcessor` over `PixtralImageProcessor`): the image processor
/// from `preprocessor_config.json` over its defaults (longest edge 1024, bicubic, rescale
/// 1/255, CLIP mean/std), the processor's `patch_size` / `spatial_merge_size` and token names
/// from `processor_config.json` (else the model config's `vision_config.patch_size` and
/// `spatial_merge_size`, and `[IMG_BREAK]` / `[IMG_END]`), the image token from
/// `image_token_index`. The break and end tokens must be in the tokenizer.
fn pixtral_processor(
    folder: &std::path::Path,
    config: &Value,
    tokenizer: &Tokenizer,
) -> Result<VisionProcessor> {
    // The size is replaced per image by the Pixtral rule (see `PixtralLayout::output_size`).
    let defaults = sized_per_image_defaults();
    let (mut raw, file) = processor_json_or_empty(folder)?;
    // `size` is Pixtral's bounds (`longest_edge`), not a shortest-edge resize.
    let (max_height, max_width) = match raw.get("size").filter(|v| !v.is_null()) {
        None => (1024, 1024),
        Some(size) => {
            let dim = |k: &str| size.get(k).and_then(Value::as_u64).map(|v| v as usize);
            match (dim("longest_edge"), dim("height"), dim("width")) {
                (Some(l), _, _) if l > 0 => (l, l),
                (None, Some(h), Some(w)) if h > 0 && w > 0 => (h, w),
                _ => {
                    return Err(LoadError::Unsupported(format!(
                    "{file}: `size` must have a positive `longest_edge`, or `height` and `width`"
                )))
                }
            }
        }
    };
    if let Value::Object(o) = &mut raw {
        o.remove("size");
    }
    let image = ImageProcessor::from_json(&raw, &defaults, &file)?;
    // PixtralProcessor's own settings.
    let processor_path = folder.join("processor_config.json");
    let processor: Value = if processor_path.is_file() {
        let text = std::fs::read_to_string(&processor_path)
            .map_err(|e| LoadError::file(&processor_path, e.to_string()))?;
        serde_json::from_str(&text)
            .map_err(|e| LoadError::file(&processor_path, format!("invalid JSON: {e}")))?
    } else {
        Value::Object(Default::default())
    };
    let positive = |v: Option<&Value>, what: &str, default: usize| -> Result<usize> {
        match v.filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|n| *n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| {
                    LoadError::Unsupported(format!("{what} = {v}: must be a positive integer"))
                }),
        }
    };
    let model_patch = positive(
        config
            .get("vision_config")
            .and_then(|v| v.get("patch_size")),
        "config.json: vision_config.patch_size",
        16,
    )?;
    let model_merge = positive(
        config.get("spatial_merge_size"),
        "config.json: spatial_merge_size",
        2,
    )?;
    let patch = positive(
        processor.get("patch_size"),
        "processor_config.json: patch_size",
        model_patch,
    )?;
    let merge = positive(
        processor.get("spatial_merge_size"),
        "processor_config.json: spatial_merge_size",
        model_merge,
    )?;
    if (patch, merge) != (model_patch, model_merge) {
        return Err(LoadError::Unsupported(format!(
            "processor_config.json: patch_size {patch} and spatial_merge_size {merge} differ from the model's ({model_patch}, {model_merge})"
        )));
    }
    let named = |key: &str, default: &str| -> Result<(u32, String)> {
        let text = processor
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_string();
        let id = tokenizer.token_to_id(&text).ok_or_else(|| {
            LoadError::Unsupported(format!(
                "{}: the tokenizer has no token `{text}` ({key} of the Pixtral processor), which prompts with images need; `\"language_model_only\": true` in config.json loads the text tower alone",
                folder.display()
            ))
        })?;
        Ok((id, text))
    };
    let (break_id, break_text) = named("image_break_token", "[IMG_BREAK]")?;
    let (end_id, end_text) = named("image_end_token", "[IMG_END]")?;
    let img = config_id(config, &["image_token_index", "image_token_id"], 10);
    let img_text = token_text(tokenizer, img, "image_token_index")?;
    Ok(VisionProcessor {
        family: ModelType::Mistral3,
        image,
        placeholder_id: img,
        content_placeholder: img_text.clone(),
        placeholder: img_text,
        // The expansion depends on the image (see `prepare_for_prompt`): no fixed one.
        expansion_text: String::new(),
        expansion_ids: Vec::new(),
        dynamic: None,
        pan_and_scan: None,
        framing_ids: Default::default(),
        square_pad: None,
        tiling: None,
        pixtral: Some(PixtralLayout {
            unit: patch * merge,
            max_height,
            max_width,
            break_id,
            break_text,
            end_id,
            end_text,
        }),
    })
}

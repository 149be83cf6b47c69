//! Images for vision-language models: decoding (PNG, JPEG, WebP through the `image` crate) and
//! the preprocessing of the HF image processors, computed as their PIL backend computes it so
//! that the pixel values a tower sees are the ones transformers feeds it:
//!
//! - [`decode_image`] / [`load_image`]: to 8-bit RGB; an image with alpha is composited over
//!   white first (transformers' `convert_to_rgb`), with PIL's `alpha_composite` arithmetic;
//! - [`resize`]: PIL's `Image.resize` — the separable two-pass convolution of `Resample.c`
//!   (fixed-point coefficients, 8-bit rounding after each pass) for bilinear, bicubic, Lanczos,
//!   box and Hamming, PIL's affine sampling for nearest;
//! - [`ImageProcessor`]: `preprocessor_config.json` (or `processor_config.json`'s
//!   `image_processor`): resize, center crop, rescale and normalise into channel-first `f32`
//!   pixel values ([`PixelValues`]).

use std::path::Path;

use serde_json::Value;

use crate::{LoadError, Result};

/// An 8-bit RGB image, rows top to bottom, `[height, width, 3]` interleaved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Columns.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// `height · width · 3` bytes.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// An image from interleaved RGB bytes; the length must be `width · height · 3`.
    pub fn new(width: usize, height: usize, data: Vec<u8>) -> Result<RgbImage> {
        if data.len() != width * height * 3 || width == 0 || height == 0 {
            return Err(LoadError::Unsupported(format!(
                "an RGB image of {width}x{height} needs {} bytes (given {})",
                width * height * 3,
                data.len()
            )));
        }
        Ok(RgbImage {
            width,
            height,
            data,
        })
    }

    fn pixel(&self, x: usize, y: usize, c: usize) -> u8 {
        self.data[(y * self.width + x) * 3 + c]
    }
}

/// PIL's `alpha_composite` of `src` over an opaque white background (`Resample`-free:
/// `AlphaComposite.c`, 7 fractional bits), what transformers' `convert_to_rgb` does to an image
/// with an alpha channel.
fn over_white(r: u8, g: u8, b: u8, a: u8) -> [u8; 3] {
    if a == 0 {
        return [255, 255, 255];
    }
    const PRECISION_BITS: u32 = 7;
    let shift_div_255 = |v: u32| ((v >> 8) + v) >> 8;
    let a = a as u32;
    let blend = 255 * (255 - a);
    let outa255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / outa255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let mix = |s: u8| {
        let t = s as u32 * coef1 + 255 * coef2;
        (shift_div_255(t + (0x80 << PRECISION_BITS)) >> PRECISION_BITS) as u8
    };
    [mix(r), mix(g), mix(b)]
}

/// Decodes a PNG, JPEG or WebP image (by its content, not a file name) to 8-bit RGB. Grey and
/// palette images become RGB; an alpha channel is composited over white as transformers'
/// `convert_to_rgb` does; 16-bit samples are reduced to 8 bits.
pub fn decode_image(bytes: &[u8]) -> Result<RgbImage> {
    let format = image::guess_format(bytes)
        .map_err(|e| LoadError::Unsupported(format!("not a PNG, JPEG or WebP image: {e}")))?;
    let decoded = image::load_from_memory_with_format(bytes, format)
        .map_err(|e| LoadError::Unsupported(format!("cannot decode the {format:?} image: {e}")))?;
    let (width, height) = (decoded.width() as usize, decoded.height() as usize);
    let data = if decoded.color().has_alpha() {
        let rgba = decoded.into_rgba8();
        rgba.pixels()
            .flat_map(|p| over_white(p[0], p[1], p[2], p[3]))
            .collect()
    } else {
        decoded.into_rgb8().into_raw()
    };
    RgbImage::new(width, height, data)
}

/// The width and height of a PNG, JPEG or WebP image, read from its header without decoding
/// its pixels: what a caller checks before [`decode_image`] allocates `width · height` pixels
/// for an image it got from elsewhere (a small file may declare a huge image).
pub fn image_dimensions(bytes: &[u8]) -> Result<(usize, usize)> {
    let format = image::guess_format(bytes)
        .map_err(|e| LoadError::Unsupported(format!("not a PNG, JPEG or WebP image: {e}")))?;
    let (width, height) = image::ImageReader::with_format(std::io::Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| LoadError::Unsupported(format!("cannot read the {format:?} image: {e}")))?;
    Ok((width as usize, height as usize))
}

/// Reads and decodes an image file ([`decode_image`]); errors name the file.
pub fn load_image(path: impl AsRef<Path>) -> Result<RgbImage> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| LoadError::file(path, e.to_string()))?;
    decode_image(&bytes).map_err(|e| LoadError::file(path, e.to_string()))
}

/// PIL's resampling filters, by the integer codes `preprocessor_config.json` stores
/// (`resample`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resample {
    /// 0.
    Nearest,
    /// 1 (also called `ANTIALIAS`).
    Lanczos,
    /// 2.
    Bilinear,
    /// 3.
    Bicubic,
    /// 4.
    Box,
    /// 5.
    Hamming,
}

impl Resample {
    /// The filter of PIL's integer code.
    pub fn from_pil(code: i64) -> Result<Resample> {
        Ok(match code {
            0 => Resample::Nearest,
            1 => Resample::Lanczos,
            2 => Resample::Bilinear,
            3 => Resample::Bicubic,
            4 => Resample::Box,
            5 => Resample::Hamming,
            other => {
                return Err(LoadError::Unsupported(format!(
                    "resample = {other}: not a PIL resampling filter (0-5)"
                )))
            }
        })
    }

    /// Half-width of the filter at scale 1 and the filter itself (`Resample.c`).
    fn filter(self) -> (f64, fn(f64) -> f64) {
        fn sinc(x: f64) -> f64 {
            if x == 0.0 {
                1.0
            } else {
                let x = x * std::f64::consts::PI;
                x.sin() / x
            }
        }
        match self {
            Resample::Box => (0.5, |x| if x > -0.5 && x <= 0.5 { 1.0 } else { 0.0 }),
            Resample::Bilinear => (1.0, |x| {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }),
            Resample::Hamming => (1.0, |x| {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    // Pillow's constants are C floats.
                    x.sin() / x * (0.54f32 as f64 + 0.46f32 as f64 * x.cos())
                }
            }),
            Resample::Bicubic => (2.0, |x| {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }),
            Resample::Lanczos => (3.0, |x| {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }),
            Resample::Nearest => (0.0, |_| 0.0),
        }
    }
}

/// Fractional bits of PIL's 8-bit resampling coefficients (`32 - 8 - 2`).
const PRECISION_BITS: u32 = 22;

/// One output position's source range and fixed-point weights.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// `precompute_coeffs` + `normalize_coeffs_8bpc` of `Resample.c` for `in_size → out_size`.
fn taps(in_size: usize, out_size: usize, filter: Resample) -> Vec<Taps> {
    let (support, f) = filter.filter();
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = support * filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let raw: Vec<f64> = (xmin..xmax)
                .map(|x| f((x as f64 - center + 0.5) * ss))
                .collect();
            let total: f64 = raw.iter().sum();
            let weights = raw
                .iter()
                .map(|w| {
                    let w = if total != 0.0 { w / total } else { *w };
                    let fixed = w * (1u64 << PRECISION_BITS) as f64;
                    if w < 0.0 {
                        (-0.5 + fixed) as i32
                    } else {
                        (0.5 + fixed) as i32
                    }
                })
                .collect();
            Taps {
                first: xmin,
                weights,
            }
        })
        .collect()
}

fn clip8(v: i64) -> u8 {
    if v >= (1i64 << PRECISION_BITS << 8) {
        255
    } else if v <= 0 {
        0
    } else {
        (v >> PRECISION_BITS) as u8
    }
}

/// One pass of the convolution along x (`horizontal`) or y, 8-bit output.
fn convolve(img: &RgbImage, taps: &[Taps], horizontal: bool) -> RgbImage {
    let (w, h) = if horizontal {
        (taps.len(), img.height)
    } else {
        (img.width, taps.len())
    };
    let mut data = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let t = &taps[if horizontal { x } else { y }];
            for c in 0..3 {
                let mut acc: i64 = 1 << (PRECISION_BITS - 1);
                for (i, k) in t.weights.iter().enumerate() {
                    let v = if horizontal {
                        img.pixel(t.first + i, y, c)
                    } else {
                        img.pixel(x, t.first + i, c)
                    };
                    acc += v as i64 * *k as i64;
                }
                data[(y * w + x) * 3 + c] = clip8(acc);
            }
        }
    }
    RgbImage {
        width: w,
        height: h,
        data,
    }
}

/// `image` resized to `width × height` exactly as PIL's `Image.resize(size, resample)` does it
/// (no `box`, no `reducing_gap`; Pillow 13's `Resample.c`): the same size is returned
/// unchanged; otherwise one pass per axis whose size changes, rounding to 8 bits after each.
pub fn resize(image: &RgbImage, width: usize, height: usize, filter: Resample) -> RgbImage {
    if image.width == width && image.height == height {
        return image.clone();
    }
    if filter == Resample::Nearest {
        // PIL maps nearest through `ImagingScaleAffine`: source coordinates accumulated in
        // steps of the scale from the first pixel centre (the accumulation's rounding decides
        // some pixels), truncated.
        let positions = |n_in: usize, n_out: usize| -> Vec<usize> {
            let step = n_in as f64 / n_out as f64;
            let mut at = step * 0.5;
            (0..n_out)
                .map(|_| {
                    let p = (at as usize).min(n_in - 1);
                    at += step;
                    p
                })
                .collect()
        };
        let (xs, ys) = (
            positions(image.width, width),
            positions(image.height, height),
        );
        let mut data = Vec::with_capacity(width * height * 3);
        for &iy in &ys {
            for &ix in &xs {
                for c in 0..3 {
                    data.push(image.pixel(ix, iy, c));
                }
            }
        }
        return RgbImage {
            width,
            height,
            data,
        };
    }
    let horizontal = |img: &RgbImage| convolve(img, &taps(image.width, width, filter), true);
    let vertical = |img: &RgbImage| convolve(img, &taps(image.height, height, filter), false);
    match (width != image.width, height != image.height) {
        (true, false) => horizontal(image),
        (false, true) => vertical(image),
        // Pillow (13) runs the vertical pass first when the height shrinks by more than twice
        // as many rows as the width loses columns; the order changes the 8-bit rounding
        // between the passes.
        _ if !(image.height > height
            && (image.height - height) as i64 > 2 * (image.width as i64 - width as i64)) =>
        {
            vertical(&horizontal(image))
        }
        _ => horizontal(&vertical(image)),
    }
}

/// Channel-first `f32` pixel values of one image, `[3, height, width]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PixelValues {
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// `3 · height · width` values, channel-major.
    pub data: Vec<f32>,
}

impl PixelValues {
    /// A 64-bit content hash (xxh3 of the shape and values): the identity of an image in a
    /// prompt, for prefix reuse.
    pub fn content_hash(&self) -> u64 {
        let mut bytes = Vec::with_capacity(16 + self.data.len() * 4);
        bytes.extend((self.height as u64).to_le_bytes());
        bytes.extend((self.width as u64).to_le_bytes());
        for v in &self.data {
            bytes.extend(v.to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }
}

/// The output size rule of `size` in a processor config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeTarget {
    /// `{"height", "width"}`: exactly this size.
    Exact {
        /// Rows.
        height: usize,
        /// Columns.
        width: usize,
    },
    /// `{"shortest_edge"}`: the shorter side to this length, the aspect ratio kept (the longer
    /// side truncated, as transformers' `get_resize_output_image_size`).
    ShortestEdge(usize),
}

impl ResizeTarget {
    /// `(height, width)` of `image` after the resize.
    pub fn output_size(&self, height: usize, width: usize) -> (usize, usize) {
        match *self {
            ResizeTarget::Exact { height, width } => (height, width),
            ResizeTarget::ShortestEdge(short) => {
                let (s, l) = (height.min(width), height.max(width));
                let long = (short as f64 * l as f64 / s as f64) as usize;
                if height <= width {
                    (short, long)
                } else {
                    (long, short)
                }
            }
        }
    }
}

/// The fields of an HF image processor config that the shared preprocessing reads (missing
/// keys take the processor class's defaults, which the caller passes in
/// [`ImageProcessor::from_json`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessor {
    /// `do_resize`.
    pub do_resize: bool,
    /// `size`.
    pub size: ResizeTarget,
    /// `resample` (PIL code).
    pub resample: Resample,
    /// `do_center_crop` with `crop_size` (height, width).
    pub center_crop: Option<(usize, usize)>,
    /// `do_rescale` with `rescale_factor`.
    pub rescale: Option<f64>,
    /// `do_normalize` with `image_mean` / `image_std`.
    pub normalize: Option<([f64; 3], [f64; 3])>,
}

/// The image processor object of a model folder and the file it came from:
/// `preprocessor_config.json`, else the `image_processor` object of `processor_config.json`.
pub fn processor_json(folder: &Path) -> Result<Option<(Value, String)>> {
    for (file, key) in [
        ("preprocessor_config.json", None),
        ("processor_config.json", Some("image_processor")),
    ] {
        let path = folder.join(file);
        if !path.is_file() {
            continue;
        }
        let text =
            std::fs::read_to_string(&path).map_err(|e| LoadError::file(&path, e.to_string()))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| LoadError::file(&path, format!("invalid JSON: {e}")))?;
        let obj = match key {
            Some(k) => match json.get(k) {
                Some(o) => o.clone(),
                None => continue,
            },
            None => json,
        };
        return Ok(Some((obj, path.display().to_string())));
    }
    Ok(None)
}

fn field<'a>(obj: &'a Value, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn config_error(file: &str, key: &str, what: &str) -> LoadError {
    LoadError::Unsupported(format!("{file}: `{key}` {what}"))
}

impl ImageProcessor {
    /// Reads a processor config object (`preprocessor_config.json`, or the `image_processor`
    /// object of `processor_config.json`) over `defaults` (the processor class's own
    /// defaults); `file` names it in errors.
    pub fn from_json(obj: &Value, defaults: &ImageProcessor, file: &str) -> Result<ImageProcessor> {
        let mut p = defaults.clone();
        let flag = |key: &str, default: bool| -> Result<bool> {
            match field(obj, key) {
                None => Ok(default),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| config_error(file, key, "must be true or false")),
            }
        };
        let triple = |key: &str, default: [f64; 3]| -> Result<[f64; 3]> {
            match field(obj, key) {
                None => Ok(default),
                Some(Value::Number(n)) => {
                    let v = n.as_f64().unwrap_or(0.0);
                    Ok([v; 3])
                }
                Some(Value::Array(a)) if a.len() == 3 => {
                    let mut out = [0.0; 3];
                    for (o, v) in out.iter_mut().zip(a) {
                        *o = v.as_f64().ok_or_else(|| {
                            config_error(file, key, "must be a list of 3 numbers")
                        })?;
                    }
                    Ok(out)
                }
                Some(_) => Err(config_error(file, key, "must be a list of 3 numbers")),
            }
        };
        p.do_resize = flag("do_resize", p.do_resize)?;
        if let Some(size) = field(obj, "size") {
            let dim = |k: &str| size.get(k).and_then(Value::as_u64).map(|v| v as usize);
            p.size = match (dim("height"), dim("width"), dim("shortest_edge")) {
                (Some(height), Some(width), _) => ResizeTarget::Exact { height, width },
                (_, _, Some(s)) => ResizeTarget::ShortestEdge(s),
                _ => {
                    return Err(config_error(
                        file,
                        "size",
                        "must have `height` and `width`, or `shortest_edge`",
                    ))
                }
            };
        }
        if let Some(r) = field(obj, "resample") {
            p.resample = Resample::from_pil(
                r.as_i64()
                    .ok_or_else(|| config_error(file, "resample", "must be an integer"))?,
            )?;
        }
        if flag("do_center_crop", p.center_crop.is_some())? {
            let crop = field(obj, "crop_size");
            let dim = |k: &str| crop.and_then(|c| c.get(k)).and_then(Value::as_u64);
            p.center_crop = match (dim("height"), dim("width"), p.center_crop) {
                (Some(h), Some(w), _) => Some((h as usize, w as usize)),
                (_, _, Some(default)) => Some(default),
                _ => {
                    return Err(config_error(
                        file,
                        "crop_size",
                        "must have `height` and `width` when do_center_crop is true",
                    ))
                }
            };
        } else {
            p.center_crop = None;
        }
        if flag("do_rescale", p.rescale.is_some())? {
            let factor = match field(obj, "rescale_factor") {
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| config_error(file, "rescale_factor", "must be a number"))?,
                None => p.rescale.unwrap_or(1.0 / 255.0),
            };
            p.rescale = Some(factor);
        } else {
            p.rescale = None;
        }
        if flag("do_normalize", p.normalize.is_some())? {
            let (mean, std) = p.normalize.unwrap_or(([0.5; 3], [0.5; 3]));
            let std = triple("image_std", std)?;
            if std.contains(&0.0) {
                return Err(config_error(file, "image_std", "must not be 0"));
            }
            p.normalize = Some((triple("image_mean", mean)?, std));
        } else {
            p.normalize = None;
        }
        Ok(p)
    }

    /// Reads the image processor config of a model folder: `preprocessor_config.json`, else
    /// the `image_processor` object of `processor_config.json`, over `defaults`; `None` when
    /// the folder has neither.
    pub fn load(folder: &Path, defaults: &ImageProcessor) -> Result<Option<ImageProcessor>> {
        match processor_json(folder)? {
            Some((json, file)) => ImageProcessor::from_json(&json, defaults, &file).map(Some),
            None => Ok(None),
        }
    }

    /// The image resized and cropped as the processor does, before rescaling (8-bit).
    pub fn resized(&self, image: &RgbImage) -> RgbImage {
        let mut img = if self.do_resize {
            let (h, w) = self.size.output_size(image.height, image.width);
            resize(image, w, h, self.resample)
        } else {
            image.clone()
        };
        if let Some((ch, cw)) = self.center_crop {
            img = center_crop(&img, ch, cw);
        }
        img
    }

    /// Pixel values `[3, H, W]` of `image`: resized, cropped, rescaled and normalised.
    pub fn preprocess(&self, image: &RgbImage) -> PixelValues {
        let img = self.resized(image);
        to_pixel_values(&img, self.rescale, self.normalize)
    }
}

/// transformers' `center_crop` of an 8-bit image (an image smaller than the crop is padded
/// with zeros around, as the numpy backend does).
pub fn center_crop(image: &RgbImage, height: usize, width: usize) -> RgbImage {
    let top = (image.height as i64 - height as i64).div_euclid(2);
    let left = (image.width as i64 - width as i64).div_euclid(2);
    let mut data = vec![0u8; height * width * 3];
    for y in 0..height {
        let sy = y as i64 + top;
        if sy < 0 || sy >= image.height as i64 {
            continue;
        }
        for x in 0..width {
            let sx = x as i64 + left;
            if sx < 0 || sx >= image.width as i64 {
                continue;
            }
            for c in 0..3 {
                data[(y * width + x) * 3 + c] = image.pixel(sx as usize, sy as usize, c);
            }
        }
    }
    RgbImage {
        width,
        height,
        data,
    }
}

/// `image` centred on a square of `colour` as wide as its longer side (transformers'
/// `pad_to_square`: the offset is the floor of half the difference); a square image is
/// returned as is.
pub fn pad_to_square(image: &RgbImage, colour: [u8; 3]) -> RgbImage {
    let side = image.width.max(image.height);
    if image.width == image.height {
        return image.clone();
    }
    let (top, left) = ((side - image.height) / 2, (side - image.width) / 2);
    let mut data: Vec<u8> = std::iter::repeat_n(colour, side * side).flatten().collect();
    for y in 0..image.height {
        let src = &image.data[y * image.width * 3..(y + 1) * image.width * 3];
        let at = ((y + top) * side + left) * 3;
        data[at..at + src.len()].copy_from_slice(src);
    }
    RgbImage {
        width: side,
        height: side,
        data,
    }
}

/// Channel-first values of an 8-bit image: `v · rescale` (in f64, stored as f32, as
/// transformers' `rescale`), then `(v - mean) / std` per channel.
pub fn to_pixel_values(
    image: &RgbImage,
    rescale: Option<f64>,
    normalize: Option<([f64; 3], [f64; 3])>,
) -> PixelValues {
    let (h, w) = (image.height, image.width);
    let mut data = vec![0f32; 3 * h * w];
    for c in 0..3 {
        for y in 0..h {
            for x in 0..w {
                let mut v = image.pixel(x, y, c) as f64;
                if let Some(r) = rescale {
                    v = ((v * r) as f32) as f64;
                }
                if let Some((mean, std)) = normalize {
                    v = (v - mean[c]) / std[c];
                }
                data[(c * h + y) * w + x] = v as f32;
            }
        }
    }
    PixelValues {
        height: h,
        width: w,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_unchanged_and_constant_images_stay_constant() {
        let img = RgbImage::new(5, 3, vec![77; 45]).unwrap();
        assert_eq!(resize(&img, 5, 3, Resample::Bicubic), img);
        for f in [
            Resample::Bilinear,
            Resample::Bicubic,
            Resample::Lanczos,
            Resample::Box,
            Resample::Hamming,
            Resample::Nearest,
        ] {
            let r = resize(&img, 7, 2, f);
            assert!(r.data.iter().all(|v| *v == 77), "{f:?}");
        }
    }

    #[test]
    fn alpha_composites_over_white() {
        assert_eq!(over_white(10, 20, 30, 255), [10, 20, 30]);
        assert_eq!(over_white(0, 0, 0, 0), [255, 255, 255]);
    }
}

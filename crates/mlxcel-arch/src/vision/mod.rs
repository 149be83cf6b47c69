//! The vision-language route (`DirectoryRoute::Vlm`): a vision tower and projector feeding the
//! registered text decoder of the checkpoint's `text_config`, mounted under its prefix.
//!
//! The pieces every family shares live here:
//!
//! - [`ImageInput`]: one preprocessed image (channel-first `f32` pixel values, `[N, 3, H, W]`
//!   for `N` tiles) with a content hash, cheap to clone and `Send`;
//! - [`VisionLanguage`]: what a family implements on top of its text decoder — the image token,
//!   how many positions an image fills, its features, the position ids (a hook for M-RoPE) and
//!   whether image tokens attend to each other bidirectionally;
//! - [`MultimodalPrompt`]: an expanded prompt (one run of image tokens per image) checked
//!   against its images, with the per-position identity keys prefix reuse compares (an image's
//!   positions are keyed by its content hash, so the same ids with another image never reuse
//!   a cache);
//! - [`forward_multimodal`]: text embeddings with the image features scattered at the image
//!   positions, through the decoder;
//! - [`load_vlm`]: the route's loader. The checkpoint's tensors are split: the text decoder is
//!   built through the registry from `text_config` (materialised per policy); the vision tower
//!   and projector are built and checked (names, shapes, unused tensors) but stay lazy — memory
//!   mapped and unread — until the first image ([`LazyTower`]);
//! - text-only detection ([`crate::detection::is_text_only`]): such a checkpoint loads its text
//!   decoder alone, and an image sent to it fails with [`no_vision_tower`].
//!
//! Adding a family is one model file (its tower, projector and [`VisionFamily`]) and one
//! registry row with `dir: Vlm`.

pub mod clip;
pub mod pixtral;
pub mod qwen2_vl;
pub mod siglip;

use std::ops::Range;
use std::sync::Arc;

use mlxcel_core::{Array, Dtype, WeightMap};
use serde_json::Value;

use crate::cache::LayerCache;
use crate::model::LanguageModel;
use crate::registry::{load_config_backed, BuildOptions, GenerationModel, LoadedModel, ModelType};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// The [`LanguageModel`] and [`crate::model::Architecture`] impls every vision-language family
/// shares: its text decoder (`self.text`) does the language work, its tower (`self.tower`,
/// loaded or not) answers [`LanguageModel::vision`], and the row builds through the `Vlm` route
/// only ([`load_vlm`]). `batched_decode = |m| ...` overrides whether conversations may decode
/// as one batch (Qwen's M-RoPE positions are not the cache offset once an image is in).
macro_rules! vlm_model_impls {
    ($model:ty, $name:literal) => {
        $crate::vision::vlm_model_impls!(
            $model,
            $name,
            batched_decode = |m: &$model| { m.text.batched_decode() }
        );
    };
    ($model:ty, $name:literal, batched_decode = $batched:expr) => {
        impl $crate::model::LanguageModel for $model {
            fn embed(&self, tokens: &mlxcel_core::Array) -> $crate::Result<mlxcel_core::Array> {
                self.text.embed(tokens)
            }

            fn forward_embeddings(
                &self,
                embeddings: &mlxcel_core::Array,
                positions: Option<&mlxcel_core::Array>,
                caches: &mut [$crate::cache::LayerCache],
                last_only: bool,
            ) -> $crate::Result<mlxcel_core::Array> {
                self.text
                    .forward_embeddings(embeddings, positions, caches, last_only)
            }

            fn vocab_size(&self) -> usize {
                self.text.vocab_size()
            }

            fn layer_schedule(&self) -> Vec<$crate::model::LayerKind> {
                self.text.layer_schedule()
            }

            fn batched_decode(&self) -> bool {
                let batched: fn(&$model) -> bool = $batched;
                batched(self)
            }

            fn decodes_on_cpu_engine(&self) -> bool {
                self.text.decodes_on_cpu_engine()
            }

            fn vision(&self) -> Option<&dyn $crate::vision::VisionLanguage> {
                self.tower
                    .as_ref()
                    .map(|_| self as &dyn $crate::vision::VisionLanguage)
            }
        }

        impl $crate::model::Architecture for $model {
            type Args = serde_json::Value;

            fn sanitize(
                args: &serde_json::Value,
                weights: &mut mlxcel_core::WeightMap,
                _quant: Option<&mlxcel_quant::QuantConfig>,
            ) -> $crate::Result<()> {
                <$model as $crate::vision::VisionFamily>::sanitize(args, weights)
            }

            fn cache_schedule(
                args: &serde_json::Value,
            ) -> $crate::Result<Vec<$crate::model::LayerKind>> {
                let vlm = <$model as $crate::vision::VisionFamily>::config(args)?;
                $crate::registry::cache_schedule(vlm.text_type, &vlm.text_config)
            }

            /// Loads through the `Vlm` route ([`crate::vision::load_vlm`]): the text decoder
            /// through the registry, the tower lazily; this single-map build is never reached
            /// (the row has no weight route).
            fn build(
                _args: &serde_json::Value,
                _w: &mut $crate::weights::ModelWeights,
            ) -> $crate::Result<Self> {
                Err($crate::ModelError::Unsupported(
                    concat!(
                        $name,
                        " builds through the Vlm route (mlxcel_arch::vision::load_vlm)"
                    )
                    .into(),
                ))
            }
        }
    };
}
pub(crate) use vlm_model_impls;

/// The error for an image sent to a model without a vision tower, exactly as the seed words
/// it: `model <path> was loaded without a vision tower (text-only checkpoint)`.
pub fn no_vision_tower(path: &str) -> ModelError {
    ModelError::Runtime(format!(
        "model {path} was loaded without a vision tower (text-only checkpoint)"
    ))
}

/// One preprocessed image: channel-first `f32` pixel values `[tiles, 3, height, width]` as
/// the family's HF image processor makes them, and a hash of them.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pixels: Arc<[f32]>,
    shape: [usize; 4],
    hash: u64,
    /// Qwen-style `(t, h, w)` patch grid, for families whose processors report one.
    pub grid_thw: Option<[usize; 3]>,
}

impl ImageInput {
    /// An image of `shape` `[tiles, 3, height, width]` from its values (row-major) and a
    /// content hash (any 64-bit hash of the values: two images with the same hash are taken
    /// to be the same image by prefix reuse).
    pub fn new(pixels: Vec<f32>, shape: [usize; 4], hash: u64) -> Result<ImageInput> {
        if pixels.len() != shape.iter().product::<usize>() || shape.contains(&0) {
            return Err(ModelError::Runtime(format!(
                "image pixel values: {} values for shape {shape:?}",
                pixels.len()
            )));
        }
        Ok(ImageInput {
            pixels: pixels.into(),
            shape,
            hash,
            grid_thw: None,
        })
    }

    /// `[tiles, 3, height, width]`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }

    /// The content hash given at construction.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The values, row-major.
    pub fn pixels(&self) -> &[f32] {
        &self.pixels
    }

    /// The pixel values as an MLX array `[tiles, 3, height, width]` in `dtype`.
    pub fn array(&self, dtype: Dtype) -> Result<Array> {
        let shape: Vec<i32> = self.shape.iter().map(|d| *d as i32).collect();
        Ok(Array::from_slice(&self.pixels, &shape)?.astype(dtype)?)
    }
}

/// What a vision-language family adds to its text decoder.
pub trait VisionLanguage {
    /// The text decoder the features are fed to.
    fn text(&self) -> &dyn LanguageModel;

    /// The id the expanded prompt holds at every image-feature position.
    fn image_token_id(&self) -> u32;

    /// Positions `image` fills in the expanded prompt (its features' rows).
    fn image_token_count(&self, image: &ImageInput) -> Result<usize>;

    /// The image's features in the decoder's hidden size, `[image_token_count, hidden]`. The
    /// first call reads the (lazy) tower's weights.
    fn image_features(&self, image: &ImageInput) -> Result<Array>;

    /// Position ids for `range` of the prompt, or `None` to continue from the caches' offset
    /// (1-D rope). Families with multi-axis positions (Qwen's M-RoPE) compute them here from
    /// the whole prompt and its images.
    fn positions(
        &self,
        prompt: &MultimodalPrompt<'_>,
        range: Range<usize>,
    ) -> Result<Option<Array>> {
        let _ = (prompt, range);
        Ok(None)
    }

    /// How far the position ids after `prompt` run ahead of its length (Qwen2-VL's
    /// `rope_deltas`: images take fewer rotary positions than tokens): decode steps after a
    /// multimodal prefill are given the explicit position `offset + delta`. 0 for 1-D rope.
    fn position_delta(&self, prompt: &MultimodalPrompt<'_>) -> Result<i64> {
        let _ = prompt;
        Ok(0)
    }

    /// Whether the positions of one image attend to each other bidirectionally (Gemma 3);
    /// causal otherwise.
    fn bidirectional_images(&self) -> bool {
        false
    }

    /// `Some((rows, cols))` when `image`'s features are not one contiguous run of the image
    /// token but `rows` runs of `cols`, each followed by one marker token of the family's own
    /// (Pixtral's `[IMG_BREAK]`, the last one `[IMG_END]`), which keeps its text embedding.
    /// The markers still belong to the image: its [`MultimodalPrompt::runs`] span them (prefix
    /// reuse keys them by the image, chunked prefill never splits them). `None`: one run.
    fn image_rows(&self, image: &ImageInput) -> Result<Option<(usize, usize)>> {
        let _ = image;
        Ok(None)
    }
}

/// An expanded prompt and its images: the `k`-th run of [`VisionLanguage::image_token_id`]
/// belongs to the `k`-th image and must be exactly as long as that image's feature count (or,
/// for an image laid out in rows ([`VisionLanguage::image_rows`]), the `k`-th group of row
/// runs, each row followed by one marker token).
#[derive(Debug, Clone)]
pub struct MultimodalPrompt<'a> {
    /// The expanded prompt.
    pub tokens: &'a [u32],
    /// The images, in prompt order.
    pub images: &'a [ImageInput],
    runs: Vec<Range<usize>>,
    /// The positions of each image that take its features, in feature order (the image's
    /// run itself unless it is laid out in rows).
    feature_runs: Vec<Vec<Range<usize>>>,
}

impl<'a> MultimodalPrompt<'a> {
    /// Checks that `tokens` holds one run of the image token per image, each of the image's
    /// length; the error says which image and what was found.
    pub fn new(
        model: &dyn VisionLanguage,
        tokens: &'a [u32],
        images: &'a [ImageInput],
    ) -> Result<MultimodalPrompt<'a>> {
        let id = model.image_token_id();
        let mut runs: Vec<Range<usize>> = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            if *t != id {
                continue;
            }
            match runs.last_mut() {
                Some(r) if r.end == i => r.end = i + 1,
                _ => runs.push(i..i + 1),
            }
        }
        // Adjacent images of the same length form one run: split it by the images' counts.
        let mut split = Vec::new();
        let mut feature_runs = Vec::new();
        let counts = images
            .iter()
            .map(|im| model.image_token_count(im))
            .collect::<Result<Vec<_>>>()?;
        let layouts = images
            .iter()
            .map(|im| model.image_rows(im))
            .collect::<Result<Vec<_>>>()?;
        let mut next = 0;
        let mut ri = 0;
        let mut at = runs.first().map_or(0, |r| r.start);
        while ri < runs.len() {
            let run = runs[ri].clone();
            let Some(&n) = counts.get(next) else {
                return Err(ModelError::Runtime(format!(
                    "the prompt has more image-token positions (id {id}) than its {} image(s) fill",
                    images.len()
                )));
            };
            if let Some((rows, cols)) = layouts[next] {
                // Rows of `cols` image tokens, one marker after each: whole runs, one apart.
                if rows * cols != n || at != run.start {
                    return Err(ModelError::Runtime(format!(
                        "image {next} ({rows} rows of {cols}) does not start a run of image tokens (id {id}) at {at}"
                    )));
                }
                let mut pieces = Vec::with_capacity(rows);
                for row in 0..rows {
                    let r = runs.get(ri + row).cloned().ok_or_else(|| {
                        ModelError::Runtime(format!(
                            "image {next} needs {rows} rows of {cols} image tokens (id {id}); the prompt has {row}"
                        ))
                    })?;
                    let after_marker = pieces.last().map(|p: &Range<usize>| p.end + 1);
                    if r.len() != cols || after_marker.is_some_and(|m| m != r.start) {
                        return Err(ModelError::Runtime(format!(
                            "image {next} needs {rows} rows of {cols} image tokens (id {id}), each followed by one marker token; row {row} is the run {r:?}"
                        )));
                    }
                    pieces.push(r);
                }
                let end = pieces[rows - 1].end + 1;
                if end > tokens.len() {
                    return Err(ModelError::Runtime(format!(
                        "image {next}: the prompt ends before the marker after its last row"
                    )));
                }
                split.push(pieces[0].start..end);
                feature_runs.push(pieces);
                ri += rows;
                at = runs.get(ri).map_or(0, |r| r.start);
                next += 1;
                continue;
            }
            if at + n > run.end {
                return Err(ModelError::Runtime(format!(
                    "image {next} needs {n} image-token positions (id {id}); the prompt's run at {at} has {}",
                    run.end - at
                )));
            }
            split.push(at..at + n);
            feature_runs.push(std::iter::once(at..at + n).collect());
            at += n;
            next += 1;
            if at == run.end {
                ri += 1;
                at = runs.get(ri).map_or(0, |r| r.start);
            }
        }
        if next != images.len() {
            return Err(ModelError::Runtime(format!(
                "{} image(s) given, but the prompt has image-token runs (id {id}) for {next}",
                images.len()
            )));
        }
        Ok(MultimodalPrompt {
            tokens,
            images,
            runs: split,
            feature_runs,
        })
    }

    /// The positions each image fills, in image order (with an image laid out in rows, its
    /// markers too: from its first image token to the marker after its last row).
    pub fn runs(&self) -> &[Range<usize>] {
        &self.runs
    }

    /// The positions that take each image's features, in image and feature order.
    pub fn feature_runs(&self) -> &[Vec<Range<usize>>] {
        &self.feature_runs
    }

    /// The identity of each position for prefix reuse: the token id for text, and for an
    /// image position a key mixing the image's hash with the offset inside the image (never
    /// equal to a token id below 2³²).
    pub fn identity_keys(&self) -> Vec<u64> {
        let mut keys: Vec<u64> = self.tokens.iter().map(|t| *t as u64).collect();
        for (run, image) in self.runs.iter().zip(self.images) {
            for (j, p) in run.clone().enumerate() {
                let mixed = image
                    .hash
                    .rotate_left(17)
                    .wrapping_add((j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                keys[p] = mixed | (1 << 63);
            }
        }
        keys
    }

    /// Prefill boundaries for chunks of about `chunk` positions that never split an image
    /// (a bidirectional image needs all its positions in one pass), from `start` on.
    pub fn chunk_ends(&self, start: usize, chunk: Option<usize>) -> Vec<usize> {
        let n = self.tokens.len();
        let step = chunk.unwrap_or(n).max(1);
        let mut ends = Vec::new();
        let mut at = start;
        while at < n {
            let mut end = (at + step).min(n);
            if let Some(r) = self.runs.iter().find(|r| r.start < end && end < r.end) {
                end = r.end;
            }
            ends.push(end);
            at = end;
        }
        ends
    }
}

/// Image features computed once per prefill, by image index.
#[derive(Debug, Default)]
pub struct FeatureCache {
    features: Vec<Option<Array>>,
}

impl FeatureCache {
    fn get(
        &mut self,
        model: &dyn VisionLanguage,
        prompt: &MultimodalPrompt<'_>,
        i: usize,
    ) -> Result<Array> {
        if self.features.len() < prompt.images.len() {
            self.features.resize(prompt.images.len(), None);
        }
        if let Some(f) = &self.features[i] {
            return Ok(f.clone());
        }
        let f = model.image_features(&prompt.images[i])?;
        let want = prompt.feature_runs[i].iter().map(Range::len).sum::<usize>() as i32;
        if f.ndim() != 2 || f.dim(0)? != want {
            return Err(ModelError::Runtime(format!(
                "image {i}: the tower gave features of shape {:?}, expected [{want}, hidden]",
                f.shape()
            )));
        }
        self.features[i] = Some(f.clone());
        Ok(f)
    }
}

/// Input embeddings `[1, L, hidden]` of `range` of the prompt: the decoder's embeddings of the
/// text positions, the image features (unscaled, as transformers' `masked_scatter`) at the
/// image positions. An image token id outside the vocabulary embeds as id 0 first (its row is
/// replaced anyway).
pub fn multimodal_embeddings(
    model: &dyn VisionLanguage,
    prompt: &MultimodalPrompt<'_>,
    range: Range<usize>,
    features: &mut FeatureCache,
) -> Result<Array> {
    let text = model.text();
    let vocab = text.vocab_size();
    let image_id = model.image_token_id();
    let ids: Vec<i32> = prompt.tokens[range.clone()]
        .iter()
        .map(|&t| {
            if t == image_id && t as usize >= vocab {
                0
            } else {
                t as i32
            }
        })
        .collect();
    let embedded = text.embed(&Array::from_slice(&ids, &[1, ids.len() as i32])?)?;
    let mut pieces = Vec::new();
    let mut at = range.start;
    // Each piece of an image's feature positions with the index of its first feature.
    let feature_pieces = prompt
        .feature_runs
        .iter()
        .enumerate()
        .flat_map(|(i, runs)| {
            runs.iter().scan(0, move |first, r| {
                let piece = (i, r.clone(), *first);
                *first += r.len();
                Some(piece)
            })
        });
    for (i, run, first) in feature_pieces {
        let (s, e) = (run.start.max(range.start), run.end.min(range.end));
        if s >= e {
            continue;
        }
        if at < s {
            pieces.push(embedded.slice_axis(
                1,
                (at - range.start) as i32,
                (s - range.start) as i32,
            )?);
        }
        let f = features.get(model, prompt, i)?;
        let f = f
            .slice_axis(
                0,
                (first + s - run.start) as i32,
                (first + e - run.start) as i32,
            )?
            .astype(embedded.dtype()?)?
            .expand_dims(&[0])?;
        pieces.push(f);
        at = e;
    }
    if pieces.is_empty() {
        return Ok(embedded);
    }
    if at < range.end {
        pieces.push(embedded.slice_axis(
            1,
            (at - range.start) as i32,
            (range.end - range.start) as i32,
        )?);
    }
    Ok(mlxcel_core::ops::concatenate(&pieces, 1)?)
}

/// `range` of a multimodal prompt through the decoder, extending `caches` (which hold the
/// positions before `range.start`): logits `[1, L, vocab]` (or of the last position only).
/// With [`VisionLanguage::bidirectional_images`] the images inside `range` are attended
/// bidirectionally (see [`LayerCache::set_bidirectional_blocks`]); `range` must then not split
/// an image ([`MultimodalPrompt::chunk_ends`]).
pub fn forward_multimodal(
    model: &dyn VisionLanguage,
    prompt: &MultimodalPrompt<'_>,
    range: Range<usize>,
    features: &mut FeatureCache,
    caches: &mut [LayerCache],
    last_only: bool,
) -> Result<Array> {
    let embeddings = multimodal_embeddings(model, prompt, range.clone(), features)?;
    let positions = model.positions(prompt, range.clone())?;
    let blocks: Vec<(usize, usize)> = if model.bidirectional_images() {
        prompt
            .runs
            .iter()
            .filter(|r| r.start < range.end && r.end > range.start)
            .map(|r| (r.start, r.end))
            .collect()
    } else {
        Vec::new()
    };
    for c in caches.iter_mut() {
        c.set_bidirectional_blocks(&blocks);
    }
    let out = model
        .text()
        .forward_embeddings(&embeddings, positions.as_ref(), caches, last_only);
    for c in caches.iter_mut() {
        c.set_bidirectional_blocks(&[]);
    }
    out
}

/// How a family builds its tower from the vision tensors.
pub type TowerBuilder<T> = fn(&Value, &VlmConfig, &mut ModelWeights) -> Result<T>;

/// A vision tower (and projector) whose weights stay on disk until the first image: at load
/// its structure is checked against the checkpoint's tensor names, shapes and dtypes (every
/// vision tensor used, none missing) without reading any data; the first [`LazyTower::get`]
/// builds it from the memory-mapped tensors, which the first forward pass then reads.
pub struct LazyTower<T> {
    config: Value,
    vlm: VlmConfig,
    map: std::cell::RefCell<Option<WeightMap>>,
    quant: Option<mlxcel_quant::QuantConfig>,
    dtype: Dtype,
    build: TowerBuilder<T>,
    name: String,
    bytes: u64,
    tower: std::cell::OnceCell<T>,
}

impl<T> std::fmt::Debug for LazyTower<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyTower")
            .field("name", &self.name)
            .field("bytes", &self.bytes)
            .field("materialized", &self.materialized())
            .finish()
    }
}

impl<T> LazyTower<T> {
    /// Checks that `build` reads exactly the tensors of `map` with their shapes (on
    /// placeholders that are never evaluated), and keeps `map` for the first use.
    pub fn new(
        name: &str,
        config: &Value,
        vlm: &VlmConfig,
        map: WeightMap,
        options: &BuildOptions,
        build: TowerBuilder<T>,
    ) -> Result<LazyTower<T>> {
        let mut shadow = WeightMap::empty(map.folder());
        for n in map.names() {
            let info = map.info(n).expect("listed");
            shadow.insert(n, mlxcel_core::ops::zeros(&info.shape, info.dtype)?)?;
        }
        let mut w = ModelWeights::new(shadow, options.quant.clone(), options.dtype);
        build(config, vlm, &mut w)?;
        w.finish(name)?;
        Ok(LazyTower {
            config: config.clone(),
            vlm: vlm.clone(),
            bytes: map.total_bytes() as u64,
            map: std::cell::RefCell::new(Some(map)),
            quant: options.quant.clone(),
            dtype: options.dtype,
            build,
            name: name.to_string(),
            tower: std::cell::OnceCell::new(),
        })
    }

    /// The tower, built from the mapped tensors on the first call.
    pub fn get(&self) -> Result<&T> {
        if let Some(t) = self.tower.get() {
            return Ok(t);
        }
        let map = self.map.borrow_mut().take().ok_or_else(|| {
            ModelError::Runtime(format!("{}: an earlier build failed", self.name))
        })?;
        let mut w = ModelWeights::new(map, self.quant.clone(), self.dtype);
        let tower = (self.build)(&self.config, &self.vlm, &mut w)?;
        w.finish(&self.name)?;
        Ok(self.tower.get_or_init(|| tower))
    }

    /// Whether the tower has been built (an image has been seen).
    pub fn materialized(&self) -> bool {
        self.tower.get().is_some()
    }

    /// Bytes of the tower's tensors as stored.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The checkpoint facts every vision-language config shares.
#[derive(Debug, Clone)]
pub struct VlmConfig {
    /// `text_config` with the family's defaults filled in.
    pub text_config: Value,
    /// The registered text decoder `text_config.model_type` names.
    pub text_type: ModelType,
    /// `vision_config`, `None` when the checkpoint is text-only.
    pub vision_config: Option<Value>,
}

/// A vision-language family: how its checkpoint is split and its tower built.
pub trait VisionFamily: Sized {
    /// The built vision tower and projector.
    type Tower;

    /// The family's name in errors.
    const NAME: &'static str;

    /// Tensor-name prefixes of the vision tower and projector after [`VisionFamily::sanitize`].
    const VISION_PREFIXES: &'static [&'static str];

    /// The config with the family's defaults (the keys real checkpoints leave to
    /// transformers' config classes), split into text and vision parts.
    fn config(config: &Value) -> Result<VlmConfig>;

    /// Renames the checkpoint's tensors into `<text decoder names>` + the vision prefixes
    /// (transformers 5's `model.language_model.*`, older `language_model.model.*`, ...).
    fn sanitize(config: &Value, weights: &mut WeightMap) -> Result<()>;

    /// Builds the tower and projector from the vision tensors (names under
    /// [`VisionFamily::VISION_PREFIXES`]).
    fn build_tower(config: &Value, vlm: &VlmConfig, w: &mut ModelWeights) -> Result<Self::Tower>;

    /// The family's model from its parts (`tower` is `None` for a text-only load).
    fn assemble(
        config: &Value,
        text: GenerationModel,
        tower: Option<LazyTower<Self::Tower>>,
    ) -> Result<Self>;
}

/// Whether a config of a vision-language type is text-only ([`crate::detection::is_text_only`])
/// given its tensors after the family's sanitiser.
fn text_only(config: &Value, weights: &WeightMap, prefixes: &[&str]) -> bool {
    let has_vision = weights
        .names()
        .any(|n| prefixes.iter().any(|p| n.starts_with(p)));
    crate::detection::is_text_only(config, has_vision)
}

/// The names of the tensors a text-only load of `model_type` leaves out (its vision tower and
/// projector), sorted; empty for other types.
pub fn unused_vision_tensors(model_type: ModelType, weights: &WeightMap) -> Vec<String> {
    let prefixes: &[&str] = match model_type {
        ModelType::Gemma3 => crate::models::gemma3::RAW_VISION_PREFIXES,
        ModelType::Llava => crate::models::llava::RAW_VISION_PREFIXES,
        ModelType::QwenVl => qwen2_vl::RAW_VISION_PREFIXES,
        ModelType::Idefics3 => crate::models::idefics3::RAW_VISION_PREFIXES,
        _ => return Vec::new(),
    };
    let mut names: Vec<String> = weights
        .names()
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

/// Builds a family's model: text decoder through the registry, tower lazily (see the module
/// docs); a text-only checkpoint drops its vision tensors.
pub fn build_family<F: VisionFamily>(
    config: &Value,
    mut weights: WeightMap,
    options: &BuildOptions,
) -> Result<F> {
    let vlm = F::config(config)?;
    F::sanitize(config, &mut weights)?;
    let text_only = vlm.vision_config.is_none() || text_only(config, &weights, F::VISION_PREFIXES);
    let is_vision = |n: &str| F::VISION_PREFIXES.iter().any(|p| n.starts_with(p));
    let mut vision = weights.clone();
    let (text_names, vision_names): (Vec<String>, Vec<String>) = weights
        .names()
        .map(str::to_string)
        .partition(|n| !is_vision(n));
    for n in &vision_names {
        weights.remove(n);
    }
    for n in &text_names {
        vision.remove(n);
    }
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or(F::NAME);
    let in_part = |part: String| {
        move |e: ModelError| ModelError::InPart {
            part,
            source: Box::new(e),
        }
    };
    let text_name = vlm.text_type.descriptor().names[0];
    let text = load_config_backed(vlm.text_type, &vlm.text_config, weights, options)
        .and_then(LoadedModel::into_generation)
        .map_err(in_part(format!(
            "model_type `{model_type}`: text decoder `{text_name}` (text_config)"
        )))?;
    let tower = if text_only {
        None
    } else {
        let name = format!("{} vision tower", F::NAME);
        Some(
            LazyTower::new(&name, config, &vlm, vision, options, F::build_tower)
                .map_err(in_part(format!("model_type `{model_type}`: vision tower")))?,
        )
    };
    F::assemble(config, text, tower)
}

/// The `Vlm` directory route: builds `model_type`'s family.
pub fn load_vlm(
    model_type: ModelType,
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    match model_type {
        ModelType::Gemma3 => Ok(LoadedModel::Generation(GenerationModel::Gemma3(Box::new(
            build_family::<crate::models::gemma3::Model>(config, weights, options)?,
        )))),
        ModelType::Llava => Ok(LoadedModel::Generation(GenerationModel::Llava(Box::new(
            build_family::<crate::models::llava::Model>(config, weights, options)?,
        )))),
        ModelType::QwenVl => Ok(LoadedModel::Generation(GenerationModel::QwenVl(Box::new(
            build_family::<qwen2_vl::Model>(config, weights, options)?,
        )))),
        ModelType::Idefics3 => Ok(LoadedModel::Generation(GenerationModel::Idefics3(
            Box::new(build_family::<crate::models::idefics3::Model>(
                config, weights, options,
            )?),
        ))),
        other => Err(ModelError::Unsupported(format!(
            "{} has no loader on the Vlm route",
            other.name()
        ))),
    }
}

/// `text_config` of a vision-language config with `defaults` filled in where the checkpoint
/// leaves a key out, and the registered text decoder its `model_type` names (`default_type`
/// when absent).
pub fn text_config_with_defaults(
    config: &Value,
    default_type: &str,
    defaults: &Value,
) -> Result<(Value, ModelType)> {
    let mut text = match config.get("text_config") {
        Some(Value::Object(o)) => Value::Object(o.clone()),
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(other) => {
            return Err(ModelError::Config(format!(
                "text_config = {other}: wrong type: must be an object"
            )))
        }
    };
    let obj = text.as_object_mut().expect("an object");
    if let Value::Object(d) = defaults {
        for (k, v) in d {
            obj.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    let name = obj
        .entry("model_type")
        .or_insert_with(|| Value::String(default_type.to_string()))
        .as_str()
        .unwrap_or(default_type)
        .to_string();
    let ty = ModelType::from_model_type(&name).ok_or_else(|| {
        ModelError::Unsupported(format!(
            "text_config.model_type = `{name}`: not a registered text decoder"
        ))
    })?;
    Ok((crate::config::sanitize_config_json(text), ty))
}

/// `vision_config` of a vision-language config with `defaults` filled in, or `None` when the
/// config makes the checkpoint text-only (absent, null or empty `vision_config`, or
/// `language_model_only: true`).
pub fn vision_config_with_defaults(config: &Value, defaults: &Value) -> Option<Value> {
    if config.get("language_model_only").and_then(Value::as_bool) == Some(true) {
        return None;
    }
    let Some(Value::Object(v)) = config.get("vision_config") else {
        return None;
    };
    if v.is_empty() {
        return None;
    }
    let mut out = v.clone();
    if let Value::Object(d) = defaults {
        for (k, val) in d {
            out.entry(k.clone()).or_insert_with(|| val.clone());
        }
    }
    Some(Value::Object(out))
}

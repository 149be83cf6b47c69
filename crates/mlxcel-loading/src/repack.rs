//! `mlxcel convert --hf DIR -q` and `cargo xtask repack`: quantize a float (f32/bf16/f16) HuggingFace checkpoint by a recipe
//! into an MLX checkpoint mlx-lm and mlxcel both load; and `cargo xtask importance`: measure
//! per-input-channel activation energy over calibration prompts for importance-weighted
//! quantization.
//!
//! Layout. Output names are mlx-lm's: per-expert HF tensors
//! (`mlp.experts.{e}.{gate,up,down}_proj`, mixtral's `block_sparse_moe.experts.{e}.w{1,2,3}`) are
//! stacked into `switch_mlp.{gate,up,down}_proj` `[experts, out, in]`, as mlx-lm's `sanitize`
//! does; nothing is dropped. The *tensor count* is therefore counted per source tensor: a
//! stacked tensor of `E` experts counts `E`, the `.scales`/`.biases` planes of a quantized
//! tensor count nothing — so the count of the output equals the source's exactly.
//!
//! Memory. Every output tensor's shape, dtype and file offset is planned from the source
//! headers before anything is computed; each shard file is created at its final size with its
//! safetensors header, and then tensors are produced one source tensor (one expert) at a time:
//! read from the memory map, quantized, written at its offset with positioned writes, dropped.
//! Peak memory is about the largest source tensor plus its planes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::IsTerminal;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::LanguageModel;
use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::importance::quantize_weighted;
use mlxcel_quant::recipe::{ModelLayout, Role};
use mlxcel_quant::{Format, QuantMode, QuantSpec, Recipe};
use serde_json::{json, Map, Value};

/// Files copied next to the weights when present.
pub const TOKENIZER_FILES: [&str; 11] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tiktoken.model",
];

/// What `repack` is asked to do.
#[derive(Debug, Clone)]
pub struct RepackOptions {
    /// Source (float) checkpoint folder.
    pub model: PathBuf,
    /// Output folder (must not exist or be empty).
    pub out: PathBuf,
    /// A built-in recipe name (`affine4-g64`, `mxfp4`, `mixed_3_6`, ...) or a YAML file path.
    pub recipe: String,
    /// Importance vectors from [`calibrate`] / [`write_importance`].
    pub importance: Option<PathBuf>,
    /// Maximum bytes per shard (a larger tensor gets a shard of its own).
    pub shard_bytes: u64,
    /// No progress bar.
    pub quiet: bool,
}

impl RepackOptions {
    /// Options with no importance vectors, 2 GiB shards and no progress bar.
    pub fn new(model: impl Into<PathBuf>, out: impl Into<PathBuf>, recipe: &str) -> Self {
        RepackOptions {
            model: model.into(),
            out: out.into(),
            recipe: recipe.to_string(),
            importance: None,
            shard_bytes: 2 << 30,
            quiet: true,
        }
    }
}

/// Bytes and logical parameters of one role.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoleStats {
    /// Logical parameters (weights, not planes).
    pub params: u64,
    /// Bytes written (weights plus scales/biases planes).
    pub bytes: u64,
}

impl RoleStats {
    /// Bytes × 8 / params (0 for no params).
    pub fn bits_per_weight(&self) -> f64 {
        if self.params == 0 {
            0.0
        } else {
            self.bytes as f64 * 8.0 / self.params as f64
        }
    }
}

/// What `repack` wrote.
#[derive(Debug, Clone, Default)]
pub struct RepackReport {
    /// The recipe's name.
    pub recipe: String,
    /// Parameters and bytes per role.
    pub by_role: BTreeMap<Role, RoleStats>,
    /// Bytes of every tensor written.
    pub total_bytes: u64,
    /// Logical parameters of every tensor written.
    pub total_params: u64,
    /// Source tensors (= output tensors counted per expert, planes not counted).
    pub tensor_count: usize,
    /// Shard file names written.
    pub shards: Vec<String>,
    /// Modules whose shape the recipe's format could not hold (kept dense).
    pub kept_dense: Vec<String>,
    /// Modules quantized with an importance vector.
    pub importance_weighted: usize,
}

impl RepackReport {
    /// Prints the per-role table and totals to stderr.
    pub fn print(&self) {
        eprintln!("recipe {}", self.recipe);
        eprintln!(
            "{:<14} {:>14} {:>14} {:>8}",
            "role", "params", "bytes", "bits/w"
        );
        for (role, s) in &self.by_role {
            eprintln!(
                "{:<14} {:>14} {:>14} {:>8.3}",
                role.name(),
                s.params,
                s.bytes,
                s.bits_per_weight()
            );
        }
        eprintln!(
            "{:<14} {:>14} {:>14} {:>8.3}",
            "total",
            self.total_params,
            self.total_bytes,
            self.total_bytes as f64 * 8.0 / self.total_params.max(1) as f64
        );
        eprintln!(
            "{} tensors in {} shard(s); {} kept dense (shape not divisible by the group); {} importance-weighted",
            self.tensor_count,
            self.shards.len(),
            self.kept_dense.len(),
            self.importance_weighted
        );
    }
}

/// One output tensor (dense copy) or module (quantized) and where its data come from.
#[derive(Debug, Clone)]
pub struct Item {
    /// Output name: the tensor name for dense items, the module path for quantized ones.
    pub out: String,
    /// Source tensors in expert order (one for unstacked tensors).
    pub sources: Vec<String>,
    /// Whether the sources are experts stacked into one `[experts, out, in]` tensor.
    pub stacked: bool,
    /// Shape of one source tensor.
    pub shape: Vec<i32>,
    /// The source's safetensors dtype tag (`F32`, `BF16`, ...).
    pub stored_dtype: String,
    /// The source's dtype.
    pub dtype: Dtype,
    /// The format the recipe picked (dense formats keep the tensor as is).
    pub format: Format,
    /// Its per-module entry in the `quantization` block, when quantized.
    pub config_entry: Option<Value>,
    /// Its role (embedding, attention, MLP, expert, ...).
    pub role: Role,
    /// The recipe wanted it quantized but its rows are not a whole number of groups.
    pub kept_dense: bool,
}

impl Item {
    fn experts(&self) -> usize {
        self.sources.len()
    }

    fn numel(&self) -> u64 {
        self.shape.iter().map(|d| *d as u64).product::<u64>() * self.experts() as u64
    }

    fn out_shape(&self, last: Option<i32>) -> Vec<i32> {
        let mut s = Vec::new();
        if self.stacked {
            s.push(self.experts() as i32);
        }
        s.extend_from_slice(&self.shape);
        if let (Some(l), Some(x)) = (last, s.last_mut()) {
            *x = l;
        }
        s
    }

    /// `(name, safetensors dtype, shape)` of every tensor this item writes.
    fn planes(&self) -> Vec<(String, String, Vec<i32>)> {
        match self.format {
            Format::Dense => vec![(
                self.out.clone(),
                self.stored_dtype.clone(),
                self.out_shape(None),
            )],
            Format::Quantized(spec) => {
                let cols = self.shape.last().copied().unwrap_or(0);
                let scale_dtype = if spec.mode == QuantMode::Affine {
                    self.stored_dtype.clone()
                } else {
                    "U8".into()
                };
                let mut v = vec![
                    (
                        format!("{}.weight", self.out),
                        "U32".to_string(),
                        self.out_shape(Some(cols * spec.bits / 32)),
                    ),
                    (
                        format!("{}.scales", self.out),
                        scale_dtype.clone(),
                        self.out_shape(Some(cols / spec.group_size)),
                    ),
                ];
                if spec.mode.has_biases() {
                    v.push((
                        format!("{}.biases", self.out),
                        scale_dtype,
                        self.out_shape(Some(cols / spec.group_size)),
                    ));
                }
                v
            }
        }
    }
}

fn st_dtype_size(tag: &str) -> Result<u64> {
    Ok(match tag {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        other => bail!("unsupported safetensors dtype `{other}`"),
    })
}

/// Splits `prefix.experts.{e}.{proj}.{suffix}` into `(out_name, e)`; mixtral's `w1/w2/w3` become
/// `gate_proj/down_proj/up_proj` as in mlx-lm.
fn expert_parts(name: &str) -> Option<(String, usize)> {
    let (prefix, rest) = name.split_once(".experts.")?;
    let (e, rest) = rest.split_once('.')?;
    let e: usize = e.parse().ok()?;
    let (proj, suffix) = rest.split_once('.')?;
    let proj = match proj {
        "w1" => "gate_proj",
        "w2" => "down_proj",
        "w3" => "up_proj",
        p => p,
    };
    Some((format!("{prefix}.switch_mlp.{proj}.{suffix}"), e))
}

/// Whether a tensor is the weight of a linear or embedding a recipe may quantize.
fn quantizable(name: &str, shape: &[i32], dtype: Dtype) -> bool {
    name.ends_with(".weight")
        && shape.len() == 2
        && dtype.is_float()
        && !name.contains("conv")
        && mlxcel_quant::recipe::classify(name) != Role::Norm
}

/// Reads `config.json` and refuses checkpoints that are already quantized.
pub fn read_source_config(model: &Path) -> Result<Value> {
    let path = model.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let config: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    for key in ["quantization", "quantization_config"] {
        if config.get(key).is_some_and(|v| !v.is_null()) {
            bail!(
                "{}: `{key}` is set: the source is already quantized; repack reads float (f32/bf16/f16) checkpoints",
                path.display()
            );
        }
    }
    Ok(config)
}

/// Plans the output: groups experts, decides every module's format.
pub fn plan(map: &WeightMap, config: &Value, recipe: &Recipe) -> Result<(Vec<Item>, ModelLayout)> {
    let mut groups: BTreeMap<String, BTreeMap<usize, String>> = BTreeMap::new();
    let mut singles: Vec<String> = Vec::new();
    for name in map.names() {
        match expert_parts(name) {
            Some((out, e)) => {
                groups.entry(out).or_default().insert(e, name.to_string());
            }
            None => singles.push(name.to_string()),
        }
    }
    let mut items = Vec::new();
    let mut push = |out: String, sources: Vec<String>, stacked: bool| -> Result<()> {
        let info = map
            .info(&sources[0])
            .ok_or_else(|| anyhow!("tensor `{}` vanished from the map", sources[0]))?;
        for s in &sources[1..] {
            let i = map
                .info(s)
                .ok_or_else(|| anyhow!("tensor `{s}` vanished from the map"))?;
            if i.shape != info.shape || i.stored_dtype != info.stored_dtype {
                bail!(
                    "expert tensor `{s}` is {} {:?}, but `{}` is {} {:?}: experts of one layer must match",
                    i.stored_dtype,
                    i.shape,
                    sources[0],
                    info.stored_dtype,
                    info.shape
                );
            }
        }
        items.push(Item {
            role: mlxcel_quant::recipe::classify(&out),
            out,
            sources,
            stacked,
            shape: info.shape.clone(),
            stored_dtype: info.stored_dtype.clone(),
            dtype: info.dtype,
            format: Format::Dense,
            config_entry: None,
            kept_dense: false,
        });
        Ok(())
    };
    for name in singles {
        push(name.clone(), vec![name], false)?;
    }
    for (out, experts) in groups {
        let n = experts.len();
        if let Some((i, _)) = experts.keys().enumerate().find(|(i, e)| *i != **e) {
            bail!("`{out}`: expert {i} of {n} is missing from the checkpoint");
        }
        push(out, experts.into_values().collect(), true)?;
    }
    items.sort_by(|a, b| a.out.cmp(&b.out));
    // Quantizable modules are named without `.weight`.
    let module_of = |it: &Item| -> Option<String> {
        if quantizable(&it.out, &it.shape, it.dtype) && it.stored_dtype != "F8_E4M3" {
            it.out.strip_suffix(".weight").map(str::to_string)
        } else {
            None
        }
    };
    let modules: Vec<String> = items.iter().filter_map(module_of).collect();
    let layout = ModelLayout::new(config, modules.iter().map(String::as_str));
    for it in &mut items {
        let Some(module) = module_of(it) else {
            it.role = layout.role(&it.out);
            continue;
        };
        let cols = it.shape.last().copied().unwrap_or(0);
        let d = recipe.decide(&module, cols, &layout);
        it.role = layout.role(&module);
        it.kept_dense = d.kept_dense;
        if let Format::Quantized(_) = d.format {
            it.out = module;
            it.format = d.format;
            it.config_entry = d.config_entry;
        }
    }
    Ok((items, layout))
}

/// The `quantization` block mlx-lm writes: defaults, then one entry per module its predicate
/// returned parameters for.
pub fn quantization_block(recipe: &Recipe, items: &[Item]) -> Value {
    let d = recipe.defaults();
    let mut block = Map::new();
    block.insert("group_size".into(), json!(d.group_size));
    block.insert("bits".into(), json!(d.bits));
    block.insert("mode".into(), json!(d.mode.name()));
    for it in items {
        if let Some(e) = &it.config_entry {
            block.insert(it.out.clone(), e.clone());
        }
    }
    Value::Object(block)
}

/// Importance vectors by module path.
pub fn read_importance(path: &Path) -> Result<BTreeMap<String, Vec<f32>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow!("{}: not a safetensors file: {e}", path.display()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 || view.shape().len() != 1 {
            bail!(
                "{}: importance `{name}` must be a 1-D F32 vector, found {:?} {:?}",
                path.display(),
                view.dtype(),
                view.shape()
            );
        }
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.insert(name, v);
    }
    Ok(out)
}

fn quantize_source(
    map: &WeightMap,
    source: &str,
    spec: QuantSpec,
    importance: Option<&[f32]>,
) -> Result<Vec<Vec<u8>>> {
    let w = map.get(source)?;
    let q = match importance {
        Some(imp) if spec.mode == QuantMode::Affine => quantize_weighted(source, &w, spec, imp)?,
        _ => w.quantize(spec)?,
    };
    let mut planes = vec![&q.weight, &q.scales];
    planes.extend(q.biases.as_ref());
    mlxcel_core::ops::eval_all(planes.iter().copied())?;
    planes
        .into_iter()
        .map(|a| Ok(a.to_bytes()?))
        .collect::<Result<Vec<_>>>()
}

struct Placed {
    shard: usize,
    offset: u64,
    len: u64,
}

/// Repacks `opts.model` into `opts.out` by `opts.recipe`.
pub fn repack(opts: &RepackOptions) -> Result<RepackReport> {
    let recipe = Recipe::resolve(&opts.recipe)?;
    let config = read_source_config(&opts.model)?;
    let map = WeightMap::open(&opts.model)?;
    let importance = match &opts.importance {
        Some(p) => read_importance(p)?,
        None => BTreeMap::new(),
    };
    let (items, _layout) = plan(&map, &config, &recipe)?;
    if opts.out.exists() && std::fs::read_dir(&opts.out)?.next().is_some() {
        bail!("{}: exists and is not empty", opts.out.display());
    }
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;

    // Plan files: every plane's size and shard.
    let mut planes: Vec<(String, String, Vec<i32>, u64)> = Vec::new();
    for it in &items {
        for (name, dtype, shape) in it.planes() {
            let n: u64 = shape.iter().map(|d| *d as u64).product();
            planes.push((name, dtype.clone(), shape, n * st_dtype_size(&dtype)?));
        }
    }
    planes.sort_by(|a, b| a.0.cmp(&b.0));
    let mut shard_of: Vec<Vec<usize>> = Vec::new();
    let mut size = 0u64;
    for (i, p) in planes.iter().enumerate() {
        if shard_of.is_empty() || (size + p.3 > opts.shard_bytes && size > 0) {
            shard_of.push(Vec::new());
            size = 0;
        }
        if let Some(s) = shard_of.last_mut() {
            s.push(i);
        }
        size += p.3;
    }
    let count = shard_of.len();
    let shard_names: Vec<String> = (0..count)
        .map(|i| {
            if count == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, count)
            }
        })
        .collect();
    let mut placed: BTreeMap<String, Placed> = BTreeMap::new();
    let mut files = Vec::new();
    for (s, members) in shard_of.iter().enumerate() {
        let mut header = Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut offset = 0u64;
        for &i in members {
            let (name, dtype, shape, len) = &planes[i];
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
            );
            offset += len;
        }
        let mut text = serde_json::to_vec(&Value::Object(header))?;
        while (text.len() + 8) % 8 != 0 {
            text.push(b' ');
        }
        let base = 8 + text.len() as u64;
        for &i in members {
            let (name, _, _, len) = &planes[i];
            placed.insert(
                name.clone(),
                Placed {
                    shard: s,
                    offset: 0,
                    len: *len,
                },
            );
        }
        let mut off = base;
        for &i in members {
            if let Some(p) = placed.get_mut(&planes[i].0) {
                p.offset = off;
                off += p.len;
            }
        }
        let path = opts.out.join(&shard_names[s]);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        file.set_len(off)?;
        file.write_all_at(&(text.len() as u64).to_le_bytes(), 0)?;
        file.write_all_at(&text, 8)?;
        files.push((path, file));
    }

    let bar = if opts.quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        let total: u64 = items.iter().map(|i| i.sources.len() as u64).sum();
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template("repack {bar:40} {pos}/{len} tensors {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    };
    let write = |name: &str, index: usize, bytes: &[u8]| -> Result<()> {
        let p = placed
            .get(name)
            .ok_or_else(|| anyhow!("internal: `{name}` was not planned"))?;
        let (path, file) = &files[p.shard];
        let n = bytes.len() as u64;
        if (index as u64 + 1) * n > p.len {
            bail!(
                "tensor `{name}`: produced {n} bytes per part, but {} were planned for the whole tensor",
                p.len
            );
        }
        file.write_all_at(bytes, p.offset + index as u64 * n)
            .with_context(|| format!("writing `{name}` to {}", path.display()))
    };
    let mut report = RepackReport {
        recipe: recipe.name(),
        tensor_count: items.iter().map(|i| i.sources.len()).sum(),
        shards: shard_names.clone(),
        ..Default::default()
    };
    for it in &items {
        bar.set_message(it.out.clone());
        let plane_names: Vec<(String, u64)> = it
            .planes()
            .iter()
            .map(|p| {
                let len = placed.get(&p.0).map_or(0, |x| x.len);
                (p.0.clone(), len)
            })
            .collect();
        match it.format {
            Format::Dense => {
                for (e, src) in it.sources.iter().enumerate() {
                    let bytes = match map.bytes(src) {
                        Some(b) => b.to_vec(),
                        None => map.get(src)?.to_bytes()?,
                    };
                    write(&plane_names[0].0, e, &bytes)?;
                    bar.inc(1);
                }
            }
            Format::Quantized(spec) => {
                let imp = importance.get(&it.out).map(Vec::as_slice);
                if imp.is_some() && spec.mode == QuantMode::Affine {
                    report.importance_weighted += 1;
                }
                for (e, src) in it.sources.iter().enumerate() {
                    let parts = quantize_source(&map, src, spec, imp)?;
                    if parts.len() != plane_names.len() {
                        bail!(
                            "tensor `{src}`: quantization produced {} planes, expected {}",
                            parts.len(),
                            plane_names.len()
                        );
                    }
                    for (bytes, (name, _)) in parts.iter().zip(&plane_names) {
                        write(name, e, bytes)?;
                    }
                    bar.inc(1);
                }
            }
        }
        let bytes: u64 = plane_names.iter().map(|p| p.1).sum();
        let stats = report.by_role.entry(it.role).or_default();
        stats.params += it.numel();
        stats.bytes += bytes;
        report.total_params += it.numel();
        report.total_bytes += bytes;
    }
    bar.finish_and_clear();
    for (path, file) in &files {
        file.sync_all()
            .with_context(|| format!("flushing {}", path.display()))?;
    }
    report.kept_dense = items
        .iter()
        .filter(|i| i.kept_dense)
        .map(|i| i.out.clone())
        .collect();

    // Index, config, tokenizer.
    let weight_map: BTreeMap<&String, &String> = placed
        .iter()
        .map(|(n, p)| (n, &shard_names[p.shard]))
        .collect();
    let index = json!({
        "metadata": {"total_size": report.total_bytes, "total_parameters": report.total_params},
        "weight_map": weight_map,
    });
    std::fs::write(
        opts.out.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    let block = quantization_block(&recipe, &items);
    let mut out_config = config.clone();
    if let Some(obj) = out_config.as_object_mut() {
        obj.insert("quantization".into(), block.clone());
        obj.insert("quantization_config".into(), block);
    }
    std::fs::write(
        opts.out.join("config.json"),
        serde_json::to_string_pretty(&out_config)?,
    )?;
    for f in TOKENIZER_FILES {
        let src = opts.model.join(f);
        if src.is_file() {
            std::fs::copy(&src, opts.out.join(f))
                .with_context(|| format!("copying {}", src.display()))?;
        }
    }
    Ok(report)
}

/// The default calibration prompts (six languages, Korean weighted heaviest by repetition, as
/// in seed 003's importance matrix).
pub const DEFAULT_PROMPTS: [&str; 8] = [
    "The quick brown fox jumps over the lazy dog while the sun sets behind the hills.",
    "한국어 문장을 이해하고 자연스럽게 답변하는 능력은 이 모델의 핵심입니다.",
    "서울의 날씨는 오늘 맑고 바람이 조금 불겠습니다. 내일은 비가 올 수 있습니다.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "La inteligencia artificial transforma la manera en que trabajamos y aprendemos.",
    "Die Quantisierung reduziert den Speicherbedarf großer Sprachmodelle erheblich.",
    "大規模言語モデルを一台の機械で動かすには、量子化が欠かせません。",
    "모델은 사용자의 질문에 정확하고 친절하게 대답해야 합니다.",
];

/// A weight's identity for the calibration hook: its shape and the bit patterns of the first
/// values of its first row (of expert 0 for stacks).
fn fingerprint(shape: &[i32], first_row: &[f32]) -> (Vec<i32>, Vec<u32>) {
    (
        shape.to_vec(),
        first_row.iter().map(|x| x.to_bits()).collect(),
    )
}

fn first_row(w: &Array, k: i32) -> mlxcel_core::Result<Vec<f32>> {
    let shape = w.shape();
    let n = shape.len();
    let start = vec![0; n];
    let mut stop: Vec<i32> = vec![1; n];
    stop[n - 1] = k;
    w.slice(&start, &stop, &vec![1; n])?
        .astype(Dtype::Float32)?
        .to_vec::<f32>()
}

/// Runs the model in `model` (a float checkpoint) over `prompts` and returns, for every dense
/// linear (and expert stack) it can attribute, the mean squared input activation per input
/// channel, keyed by the module path repack writes (`switch_mlp` for experts: one vector for all
/// experts of a layer, from every token routed to any of them).
///
/// Attribution works through the calibration hook of `mlxcel_arch::nn::calibration`: each
/// forward reports the weight array it multiplies; the weight is matched to a checkpoint tensor
/// by shape and the exact values of its first row (load-time transforms that change a linear's
/// weight — none in the float loaders — would leave it unmatched, so it gets no importance).
pub fn calibrate(model: &Path, prompts: &[String]) -> Result<BTreeMap<String, Vec<f32>>> {
    use std::cell::RefCell;
    use std::rc::Rc;

    const K: i32 = 16;
    let config = read_source_config(model)?;
    let map = WeightMap::open(model)?;
    let recipe = Recipe::resolve("affine8-g32")?;
    let (items, _) = plan(&map, &config, &recipe)?;
    let mut table: BTreeMap<(Vec<i32>, Vec<u32>), String> = BTreeMap::new();
    for it in &items {
        let Some(module) = it
            .out
            .strip_suffix(".weight")
            .map(str::to_string)
            .or_else(|| matches!(it.format, Format::Quantized(_)).then(|| it.out.clone()))
        else {
            continue;
        };
        if it.shape.len() != 2 || !it.dtype.is_float() {
            continue;
        }
        let k = K.min(it.shape[1]);
        let row = first_row(&map.get(&it.sources[0])?, k)?;
        let mut shape = Vec::new();
        if it.stacked {
            shape.push(it.sources.len() as i32);
        }
        shape.extend_from_slice(&it.shape);
        table.insert(fingerprint(&shape, &row), module);
    }
    drop(map);
    let loaded = crate::load_model(
        model,
        &crate::LoadOptions {
            dtype: Some(Dtype::Float32),
            ..Default::default()
        },
    )?;
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .ok_or_else(|| anyhow!("{}: no tokenizer to encode prompts", model.display()))?;
    type Acc = BTreeMap<String, (Vec<f64>, u64)>;
    let acc: Rc<RefCell<Acc>> = Rc::new(RefCell::new(BTreeMap::new()));
    let errors: Rc<RefCell<Vec<String>>> = Rc::new(RefCell::new(Vec::new()));
    let table = Rc::new(table);
    let (acc2, err2, table2) = (acc.clone(), errors.clone(), table.clone());
    let observer = Box::new(move |w: &Array, x: &Array| {
        let run = || -> mlxcel_core::Result<()> {
            let shape = w.shape();
            let cols = shape.last().copied().unwrap_or(0);
            let row = first_row(w, K.min(cols))?;
            let Some(module) = table2.get(&fingerprint(&shape, &row)) else {
                return Ok(());
            };
            let x2 = x.astype(Dtype::Float32)?.reshape(&[-1, cols])?;
            let rows = x2.shape()[0] as u64;
            let sums = x2.square()?.sum(&[0], false)?.to_vec::<f32>()?;
            let mut a = acc2.borrow_mut();
            let entry = a
                .entry(module.clone())
                .or_insert_with(|| (vec![0.0; cols as usize], 0));
            for (t, s) in entry.0.iter_mut().zip(&sums) {
                *t += *s as f64;
            }
            entry.1 += rows;
            Ok(())
        };
        if let Err(e) = run() {
            err2.borrow_mut().push(e.to_string());
        }
    });
    let model_ref = &loaded.model;
    mlxcel_arch::nn::calibration::with_linear_observer(observer, || -> Result<()> {
        for p in prompts {
            let ids: Vec<i32> = tokenizer
                .encode(p, false)?
                .iter()
                .map(|t| *t as i32)
                .collect();
            if ids.is_empty() {
                continue;
            }
            let tokens = Array::from_slice(&ids, &[1, ids.len() as i32])?;
            let mut caches = model_ref.make_caches();
            model_ref.forward(&tokens, &mut caches)?.eval()?;
        }
        Ok(())
    })?;
    if let Some(e) = errors.borrow().first() {
        bail!("calibration hook: {e}");
    }
    let acc = acc.borrow();
    Ok(acc
        .iter()
        .map(|(m, (sum, n))| {
            (
                m.clone(),
                sum.iter()
                    .map(|s| (*s / (*n).max(1) as f64) as f32)
                    .collect(),
            )
        })
        .collect())
}

/// Writes importance vectors as a safetensors file (`{module}` → f32 `[in]`).
pub fn write_importance(path: &Path, importance: &BTreeMap<String, Vec<f32>>) -> Result<()> {
    let mut tensors = Vec::new();
    for (name, v) in importance {
        tensors.push((name.clone(), Array::from_slice(v, &[v.len() as i32])?));
    }
    mlxcel_core::weights::save_safetensors(path, &tensors, None)?;
    Ok(())
}

/// Reads the prompts file (one prompt per non-empty line) or the defaults.
pub fn read_prompts(path: Option<&Path>) -> Result<Vec<String>> {
    match path {
        None => Ok(DEFAULT_PROMPTS.iter().map(|s| s.to_string()).collect()),
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let v: Vec<String> = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect();
            if v.is_empty() {
                bail!("{}: no prompts", p.display());
            }
            Ok(v)
        }
    }
}

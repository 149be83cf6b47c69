//! Load-time weight surgery: a YAML list of edits applied, in order, to the sanitised checkpoint
//! before the model is built ([`crate::LoadOptions::surgery`], `mlxcel generate --surgery`).
//!
//! ```yaml
//! - op: scale                 # multiply by a factor
//!   target: 'model\.layers\.0\.mlp\..*_proj\.weight'   # a regex over the whole name
//!   factor: 0.5
//! - op: add                   # add a constant (`value`) or a tensor (`file`, same-named or `tensor`)
//!   glob: 'model.norm.weight' # or a glob (`*` any run of characters, `?` one)
//!   value: 0.1
//! - op: prune                 # remove attention heads from every layer (see below)
//!   glob: 'model.layers.*.self_attn'
//!   heads: [2, 3]
//! - op: prune                 # remove MLP channels: rows of gate/up_proj, columns of down_proj
//!   glob: 'model.layers.*.mlp'
//!   rows: [0, 5]
//! - op: prune                 # remove decoder layers; the rest are renumbered
//!   glob: 'model.layers'
//!   layers: [1]
//! - op: replace               # the tensor from another safetensors file (same shape and dtype)
//!   glob: 'lm_head.weight'
//!   file: other.safetensors   # relative to this YAML's folder, or absolute
//! - op: interpolate           # (1 - t) * this + t * the same-named tensor of another checkpoint
//!   glob: 'model.layers.*.self_attn.*.weight'
//!   checkpoint: ../other-model
//!   t: 0.25
//! ```
//!
//! `prune` removes whole structures and updates `config.json`'s view of the model to match (the
//! model is then built from the updated config; [`crate::Loaded::config`] is the updated one).
//! Its target names modules (a dotted prefix of tensor names), not tensors:
//! - `heads`: attention modules with `q_proj`, `k_proj`, `v_proj` and `o_proj` (and optional
//!   biases, `q_norm`/`k_norm`, `sinks`): the heads' rows of q/k/v and columns of o_proj go.
//!   The config has one head count for all layers, so every layer's attention must be matched;
//!   under grouped-query attention only whole key/value groups can go (query heads
//!   `g·r .. (g+1)·r − 1` for `r` = query heads per key/value head), which removes the group's
//!   key/value head too. Updates `num_attention_heads`, `num_key_value_heads` and writes
//!   `head_dim` (which would otherwise be re-derived from the smaller head count).
//! - `rows`: dense MLP modules (`gate_proj`/`up_proj`/`down_proj`, or `up_proj`/`down_proj`):
//!   those intermediate channels, in every layer; updates `intermediate_size`.
//! - `layers`: the decoder's layer list (`model.layers`, holding `.0` .. `.{num_hidden_layers -
//!   1}`): the layers go, the rest are renumbered, and `num_hidden_layers` and the per-layer
//!   lists `layer_types` / `no_rope_layers` are updated. Configs that place layers by position
//!   some other way (`sliding_window_pattern`, `decoder_sparse_step`, `mlp_only_layers`, ...)
//!   are refused, as are families whose layer pattern follows the index when `layer_types` is
//!   absent.
//!
//! A prune that cannot keep the model consistent (a partial layer set, a split key/value group,
//! every head or layer, an unknown tensor inside the module) is refused.
//!
//! A quantized target (a `.weight` with `.scales`) of `scale`, `add`, `replace` or
//! `interpolate` is dequantized to float32, edited, and quantized again with the layer's own
//! mode, bits and group size (its `.scales`/`.biases` planes follow it; the report line says
//! so); a `prune` on a quantized module is refused.
//!
//! A rule that matches nothing, a shape or dtype mismatch, a missing file, an integer target,
//! an impossible prune or a non-finite result is an error naming the rule (1-based), its op and
//! target. Every rule is computed first; the map and the config are only
//! changed once all succeeded.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use mlxcel_arch::ModelError;
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::{QuantConfig, QuantizedWeight, TensorQuant};
use regex::Regex;
use serde::Deserialize;
use serde_json::Value;

use crate::{LoadError, Result};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    op: String,
    target: Option<String>,
    glob: Option<String>,
    factor: Option<f64>,
    value: Option<f64>,
    file: Option<String>,
    tensor: Option<String>,
    rows: Option<Vec<i64>>,
    cols: Option<Vec<i64>>,
    heads: Option<Vec<i64>>,
    layers: Option<Vec<i64>>,
    checkpoint: Option<String>,
    t: Option<f64>,
}

#[derive(Debug, Clone)]
enum Edit {
    Scale(f64),
    AddValue(f64),
    AddFile {
        file: PathBuf,
        tensor: Option<String>,
    },
    Prune(Prune),
    Replace {
        file: PathBuf,
        tensor: Option<String>,
    },
    Interpolate {
        checkpoint: PathBuf,
        t: f64,
    },
}

/// What a `prune` rule removes (the indices are checked for range when it runs).
#[derive(Debug, Clone)]
enum Prune {
    /// Query heads of attention modules (whole key/value groups under GQA).
    Heads(Vec<i64>),
    /// Intermediate channels of dense MLP modules.
    Rows(Vec<i64>),
    /// Decoder layers of the layer list.
    Layers(Vec<i64>),
}

#[derive(Debug, Clone)]
struct Rule {
    /// 1-based position in the YAML list.
    index: usize,
    op: String,
    target: String,
    matcher: Regex,
    edit: Edit,
}

impl Rule {
    fn label(&self) -> String {
        format!("rule {} ({} `{}`)", self.index, self.op, self.target)
    }
}

/// A parsed surgery file: its rules, checked for form (ops, fields, patterns, files).
#[derive(Debug, Clone)]
pub struct Surgery {
    path: PathBuf,
    rules: Vec<Rule>,
}

/// A glob (`*`: any run of characters, `?`: one character) as an anchored regex.
fn glob_regex(glob: &str) -> String {
    let mut out = String::from("^");
    for c in glob.chars() {
        match c {
            '*' => out.push_str(".*"),
            '?' => out.push('.'),
            c => out.push_str(&regex::escape(&c.to_string())),
        }
    }
    out.push('$');
    out
}

impl Surgery {
    /// Reads and checks a surgery YAML file (see the module docs for the format). Relative file
    /// and checkpoint paths are resolved against the YAML's folder and must exist.
    pub fn load(path: impl AsRef<Path>) -> Result<Surgery> {
        let path = path.as_ref().to_path_buf();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| LoadError::file(&path, format!("surgery file: {e}")))?;
        let raw: Vec<RawRule> = serde_yaml::from_str(&text).map_err(|e| {
            LoadError::file(
                &path,
                format!("surgery file: expected a YAML list of rules: {e}"),
            )
        })?;
        if raw.is_empty() {
            return Err(LoadError::file(&path, "surgery file: no rules"));
        }
        let base = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let mut rules = Vec::with_capacity(raw.len());
        for (i, r) in raw.into_iter().enumerate() {
            let index = i + 1;
            let target = r.target.clone().or(r.glob.clone()).unwrap_or_default();
            let bad = |msg: String| {
                LoadError::file(&path, format!("rule {index} ({} `{target}`): {msg}", r.op))
            };
            let pattern = match (&r.target, &r.glob) {
                (Some(t), None) => format!("^(?:{t})$"),
                (None, Some(g)) => glob_regex(g),
                _ => return Err(bad("give exactly one of `target` (regex) or `glob`".into())),
            };
            let matcher = Regex::new(&pattern).map_err(|e| bad(format!("invalid pattern: {e}")))?;
            let resolve = |name: &str, folder: bool| -> Result<PathBuf> {
                let p = Path::new(name);
                let p = if p.is_absolute() {
                    p.to_path_buf()
                } else {
                    base.join(p)
                };
                let ok = if folder { p.is_dir() } else { p.is_file() };
                if !ok {
                    return Err(bad(format!(
                        "{} {} does not exist (relative paths are relative to the surgery file's folder)",
                        if folder { "checkpoint folder" } else { "file" },
                        p.display()
                    )));
                }
                Ok(p)
            };
            // Which fields each op takes; any other is an error.
            let allowed: &[&str] = match r.op.as_str() {
                "scale" => &["factor"],
                "add" => &["value", "file", "tensor"],
                "prune" => &["rows", "cols", "heads", "layers"],
                "replace" => &["file", "tensor"],
                "interpolate" => &["checkpoint", "t"],
                other => {
                    return Err(bad(format!(
                        "unknown op `{other}` (expected scale, add, prune, replace or interpolate)"
                    )))
                }
            };
            let given = [
                ("factor", r.factor.is_some()),
                ("value", r.value.is_some()),
                ("file", r.file.is_some()),
                ("tensor", r.tensor.is_some()),
                ("rows", r.rows.is_some()),
                ("cols", r.cols.is_some()),
                ("heads", r.heads.is_some()),
                ("layers", r.layers.is_some()),
                ("checkpoint", r.checkpoint.is_some()),
                ("t", r.t.is_some()),
            ];
            if let Some((field, _)) = given.iter().find(|(f, g)| *g && !allowed.contains(f)) {
                return Err(bad(format!("field `{field}` does not apply to `{}`", r.op)));
            }
            let finite = |v: f64, what: &str| {
                if v.is_finite() {
                    Ok(v)
                } else {
                    Err(bad(format!("`{what}` must be finite")))
                }
            };
            let edit = match r.op.as_str() {
                "scale" => Edit::Scale(finite(
                    r.factor.ok_or_else(|| bad("needs `factor`".into()))?,
                    "factor",
                )?),
                "add" => match (r.value, &r.file) {
                    (Some(v), None) if r.tensor.is_none() => Edit::AddValue(finite(v, "value")?),
                    (None, Some(f)) => Edit::AddFile {
                        file: resolve(f, false)?,
                        tensor: r.tensor.clone(),
                    },
                    _ => {
                        return Err(bad(
                            "needs either `value` or `file` (with an optional `tensor`)".into(),
                        ))
                    }
                },
                "prune" => {
                    if r.cols.is_some() {
                        return Err(bad("`cols` alone cannot keep the model's shapes consistent: prune MLP channels with `rows` on the MLP modules (rows of gate/up_proj and the same columns of down_proj)".into()));
                    }
                    match (r.heads.clone(), r.rows.clone(), r.layers.clone()) {
                        (Some(h), None, None) if !h.is_empty() => Edit::Prune(Prune::Heads(h)),
                        (None, Some(rw), None) if !rw.is_empty() => Edit::Prune(Prune::Rows(rw)),
                        (None, None, Some(l)) if !l.is_empty() => Edit::Prune(Prune::Layers(l)),
                        _ => {
                            return Err(bad(
                                "needs exactly one non-empty list of `heads`, `rows` (MLP channels) or `layers`".into(),
                            ))
                        }
                    }
                }
                "replace" => Edit::Replace {
                    file: resolve(
                        r.file
                            .as_deref()
                            .ok_or_else(|| bad("needs `file`".into()))?,
                        false,
                    )?,
                    tensor: r.tensor.clone(),
                },
                _ => {
                    let t = finite(r.t.ok_or_else(|| bad("needs `t`".into()))?, "t")?;
                    Edit::Interpolate {
                        checkpoint: resolve(
                            r.checkpoint
                                .as_deref()
                                .ok_or_else(|| bad("needs `checkpoint`".into()))?,
                            true,
                        )?,
                        t,
                    }
                }
            };
            rules.push(Rule {
                index,
                op: r.op.clone(),
                target,
                matcher,
                edit,
            });
        }
        Ok(Surgery { path, rules })
    }

    /// The surgery file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Applies every rule in order to `weights` and `config` (the sanitised `config.json`,
    /// which a `prune` updates to the pruned shapes). All results are computed (and checked)
    /// first; neither is changed unless every rule succeeded. Returns one line per rule saying
    /// what it did.
    pub fn apply(
        &self,
        weights: &mut WeightMap,
        config: &mut Value,
        quant: Option<&QuantConfig>,
    ) -> mlxcel_arch::Result<Vec<String>> {
        let mut staged = Staged {
            base: weights,
            edits: BTreeMap::new(),
        };
        let mut cfg = config.clone();
        let mut applied = Vec::with_capacity(self.rules.len());
        for rule in &self.rules {
            let fail = |msg: String| {
                ModelError::Transform(format!(
                    "surgery {}: {}: {msg}",
                    self.path.display(),
                    rule.label()
                ))
            };
            let what = match &rule.edit {
                Edit::Prune(prune) => {
                    prune_structure(prune, &rule.matcher, &mut staged, &mut cfg).map_err(fail)?
                }
                edit => {
                    let (n, requantized) =
                        edit_tensors(edit, &rule.matcher, &mut staged, quant).map_err(fail)?;
                    let how = if requantized.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " ({} quantized: dequantized, edited and requantized at the layer's own {})",
                            requantized.len(),
                            requantized
                                .values()
                                .cloned()
                                .collect::<BTreeSet<_>>()
                                .into_iter()
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    };
                    format!("on {n} tensor{}{how}", if n == 1 { "" } else { "s" })
                }
            };
            applied.push(format!(
                "surgery rule {}: {} `{}` {what}",
                rule.index, rule.op, rule.target
            ));
        }
        let edits = std::mem::take(&mut staged.edits);
        for (name, array) in edits {
            match array {
                Some(a) => weights.insert(name, a)?,
                None => {
                    weights.remove(&name);
                }
            }
        }
        *config = cfg;
        Ok(applied)
    }

    /// Whether a rule removes structure (a `prune`), which changes shapes and may renumber
    /// layers: unfused adapters, attached by name and shape, cannot follow it.
    pub fn changes_structure(&self) -> bool {
        self.rules.iter().any(|r| matches!(r.edit, Edit::Prune(_)))
    }
}

/// The checkpoint as the rules see it while they run: the map with the staged edits over it
/// (`None`: removed). Nothing reaches the map until every rule succeeded.
struct Staged<'a> {
    base: &'a WeightMap,
    edits: BTreeMap<String, Option<Array>>,
}

impl Staged<'_> {
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .base
            .names()
            .filter(|n| !matches!(self.edits.get(*n), Some(None)))
            .map(str::to_string)
            .chain(
                self.edits
                    .iter()
                    .filter(|(n, a)| a.is_some() && !self.base.contains(n))
                    .map(|(n, _)| n.clone()),
            )
            .collect();
        names.sort();
        names
    }

    fn contains(&self, name: &str) -> bool {
        match self.edits.get(name) {
            Some(a) => a.is_some(),
            None => self.base.contains(name),
        }
    }

    fn get(&self, name: &str) -> std::result::Result<Array, String> {
        match self.edits.get(name) {
            Some(Some(a)) => Ok(a.clone()),
            Some(None) => Err(format!("`{name}` was removed by an earlier rule")),
            None => self.base.get(name).map_err(|e| e.to_string()),
        }
    }

    fn set(&mut self, name: impl Into<String>, array: Array) {
        self.edits.insert(name.into(), Some(array));
    }

    fn remove(&mut self, name: &str) {
        self.edits.insert(name.to_string(), None);
    }

    /// Refuses a quantized `name` (one with a `.scales` sibling).
    fn refuse_quantized(&self, name: &str) -> std::result::Result<(), String> {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        if self.contains(&format!("{base}.scales")) {
            return Err(format!(
                "`{name}` is quantized (it has a `.scales` sibling): surgery on quantized weights is not supported yet"
            ));
        }
        Ok(())
    }
}

/// The quantized weight `name` (a `.weight` with a `.scales` sibling), with its format from
/// `quant`; `None` for a plain tensor.
fn quantized_target(
    staged: &Staged,
    name: &str,
    quant: Option<&QuantConfig>,
) -> std::result::Result<Option<QuantizedWeight>, String> {
    let Some(module) = name.strip_suffix(".weight") else {
        return Ok(None);
    };
    let scales = format!("{module}.scales");
    if !staged.contains(&scales) {
        return Ok(None);
    }
    let Some(TensorQuant::Quantized {
        mode,
        group_size,
        bits,
    }) = quant.map(|q| q.for_module(module))
    else {
        return Err(format!(
            "`{name}` has `{scales}` but config.json does not quantize it"
        ));
    };
    let biases = format!("{module}.biases");
    let biases = if staged.contains(&biases) {
        Some(staged.get(&biases)?)
    } else {
        None
    };
    QuantizedWeight::new(
        name,
        staged.get(name)?,
        staged.get(&scales)?,
        biases,
        mode,
        group_size,
        bits,
    )
    .map(Some)
    .map_err(|e| e.to_string())
}

/// Whether `name` is a `.scales` / `.biases` plane of a quantized weight (edited with it).
fn is_quantization_plane(staged: &Staged, name: &str) -> bool {
    [".scales", ".biases"].iter().any(|suffix| {
        name.strip_suffix(suffix).is_some_and(|module| {
            staged.contains(&format!("{module}.weight"))
                && staged.contains(&format!("{module}.scales"))
        })
    })
}

/// `scale`, `add`, `replace` and `interpolate` on every tensor `matcher` matches; returns how
/// many, and the quantized ones (name → format) that were dequantized, edited and requantized
/// with their own mode, bits and group size (their `.scales`/`.biases` planes go with them).
fn edit_tensors(
    edit: &Edit,
    matcher: &Regex,
    staged: &mut Staged,
    quant: Option<&QuantConfig>,
) -> std::result::Result<(usize, BTreeMap<String, String>), String> {
    let core = |e: mlxcel_core::Error| e.to_string();
    let matched: Vec<String> = staged
        .names()
        .into_iter()
        .filter(|n| matcher.is_match(n))
        .collect();
    let names: Vec<String> = matched
        .iter()
        .filter(|n| !is_quantization_plane(staged, n))
        .cloned()
        .collect();
    if names.is_empty() {
        return Err(match matched.first() {
            None => "matches no tensor of the model".into(),
            Some(plane) => format!(
                "matches only quantization planes (`{plane}`, ...): target the `.weight` they quantize"
            ),
        });
    }
    let mut requantized = BTreeMap::new();
    let source = match edit {
        Edit::AddFile { file, .. } | Edit::Replace { file, .. } => {
            Some(WeightMap::open_file(file).map_err(core)?)
        }
        Edit::Interpolate { checkpoint, .. } => Some(WeightMap::open(checkpoint).map_err(core)?),
        _ => None,
    };
    let named = match edit {
        Edit::AddFile { tensor, .. } | Edit::Replace { tensor, .. } => tensor.clone(),
        _ => None,
    };
    if named.is_some() && names.len() != 1 {
        return Err(format!(
            "`tensor` names one source tensor but the target matches {} tensors",
            names.len()
        ));
    }
    for name in &names {
        let packed = quantized_target(staged, name, quant)?;
        let current = match &packed {
            Some(q) => q.dequantize(Dtype::Float32).map_err(core)?,
            None => staged.get(name)?,
        };
        let dtype = current.dtype().map_err(core)?;
        if !dtype.is_float() {
            return Err(format!(
                "`{name}` has dtype {dtype}: only floating-point tensors can be edited (quantized weights are not supported yet)"
            ));
        }
        let shape = current.shape();
        // The other tensor (add from a file, replace, interpolate): same shape and dtype.
        let other = match &source {
            Some(src) => {
                let from = named.as_deref().unwrap_or(name);
                let what = match edit {
                    Edit::Interpolate { checkpoint, .. } => checkpoint.display().to_string(),
                    Edit::AddFile { file, .. } | Edit::Replace { file, .. } => {
                        file.display().to_string()
                    }
                    _ => String::new(),
                };
                let o = src
                    .get(from)
                    .map_err(|_| format!("{what} has no tensor `{from}` (for `{name}`)"))?;
                if o.shape() != shape {
                    return Err(format!(
                        "shape mismatch: `{name}` is {shape:?} but `{from}` in {what} is {:?}",
                        o.shape()
                    ));
                }
                let od = o.dtype().map_err(core)?;
                // A quantized target is edited in float32 whatever the source's float dtype.
                if packed.is_none() && od != dtype {
                    return Err(format!(
                        "dtype mismatch: `{name}` is {dtype} but `{from}` in {what} is {od}"
                    ));
                }
                Some(o)
            }
            None => None,
        };
        let new = edit_tensor(edit, &current, other.as_ref())
            .map_err(|e| format!("`{name}`: {e}"))?
            .astype(dtype)
            .map_err(core)?;
        // Any inf or NaN makes the sum of x * 0 NaN.
        let axes: Vec<i32> = (0..new.ndim() as i32).collect();
        let probe = new
            .astype(Dtype::Float32)
            .and_then(|a| a.mul_scalar(0.0))
            .and_then(|a| a.sum(&axes, false))
            .and_then(|a| a.item())
            .map_err(core)?;
        if !probe.is_finite() {
            return Err(format!(
                "the result for `{name}` is not finite (inf or NaN)"
            ));
        }
        match packed {
            None => staged.set(name.clone(), new),
            Some(q) => {
                let module = name.trim_end_matches(".weight");
                let scales_dtype = q.scales.dtype().map_err(core)?;
                let planes = new.quantize(q.spec).map_err(core)?;
                // Affine scales and biases go back to the dtype they were stored in.
                let restore = |a: Array| -> std::result::Result<Array, String> {
                    if a.dtype().map_err(core)?.is_float() {
                        a.astype(scales_dtype).map_err(core)
                    } else {
                        Ok(a)
                    }
                };
                staged.set(name.clone(), planes.weight);
                staged.set(format!("{module}.scales"), restore(planes.scales)?);
                if let Some(b) = planes.biases {
                    staged.set(format!("{module}.biases"), restore(b)?);
                }
                requantized.insert(
                    name.clone(),
                    format!(
                        "{} {}-bit g{}",
                        q.spec.mode.name(),
                        q.spec.bits,
                        q.spec.group_size
                    ),
                );
            }
        }
    }
    Ok((names.len(), requantized))
}

fn edit_tensor(
    edit: &Edit,
    current: &Array,
    other: Option<&Array>,
) -> std::result::Result<Array, mlxcel_core::Error> {
    let x = current.astype(Dtype::Float32)?;
    let other32 = || {
        other
            .expect("a source tensor for this op")
            .astype(Dtype::Float32)
    };
    match edit {
        Edit::Scale(f) => x.mul_scalar(*f),
        Edit::AddValue(v) => x.add_scalar(*v),
        Edit::AddFile { .. } => x.add(&other32()?),
        Edit::Replace { .. } => other32(),
        Edit::Interpolate { t, .. } => x.mul_scalar(1.0 - t)?.add(&other32()?.mul_scalar(*t)?),
        Edit::Prune(_) => unreachable!("prune is structural (prune_structure)"),
    }
}

/// The modules (dotted prefixes of tensor names) `matcher` matches, sorted.
fn matched_modules(staged: &Staged, matcher: &Regex) -> Vec<String> {
    let mut found = BTreeSet::new();
    for name in staged.names() {
        for (i, c) in name.char_indices() {
            if c == '.' && matcher.is_match(&name[..i]) {
                found.insert(name[..i].to_string());
            }
        }
    }
    found.into_iter().collect()
}

fn config_int(cfg: &Value, key: &str) -> std::result::Result<i64, String> {
    cfg.get(key)
        .and_then(Value::as_i64)
        .ok_or_else(|| format!("config.json has no integer `{key}` to update"))
}

/// `0..len` without `drop`; out-of-range or repeated indices, and removing all, are refused.
fn kept_indices(len: i64, drop: &[i64], what: &str) -> std::result::Result<Vec<i64>, String> {
    let mut set = BTreeSet::new();
    for &i in drop {
        if i < 0 || i >= len {
            return Err(format!(
                "{what} index {i} is out of range (there are {len})"
            ));
        }
        if !set.insert(i) {
            return Err(format!("{what} index {i} is listed twice"));
        }
    }
    if set.len() as i64 == len {
        return Err(format!("it would remove every {what} (all {len})"));
    }
    Ok((0..len).filter(|i| !set.contains(i)).collect())
}

/// `units` (each `width` wide) expanded to the element indices they cover along one axis.
fn expand(units: &[i64], width: i64) -> Vec<i64> {
    units
        .iter()
        .flat_map(|u| u * width..(u + 1) * width)
        .collect()
}

/// `a` with only `keep` along `axis`, after checking that axis has `len` entries.
fn keep_along(
    name: &str,
    a: &Array,
    axis: usize,
    len: i64,
    keep: &[i64],
) -> std::result::Result<Array, String> {
    let shape = a.shape();
    if shape.get(axis).map(|&d| d as i64) != Some(len) {
        return Err(format!(
            "`{name}` has shape {shape:?}, expected {len} along axis {axis} from config.json"
        ));
    }
    let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
    let idx = Array::from_slice(&idx, &[idx.len() as i32]).map_err(|e| e.to_string())?;
    // A take along a later axis can come back as a strided view; the CPU linear kernel reads
    // weights row-major.
    a.take(&idx, axis as i32)
        .and_then(|t| t.contiguous())
        .map_err(|e| e.to_string())
}

/// The tensors under `module.` as (suffix, full name), after checking it has every `needed`
/// one (else it is not a `what`) and nothing outside `known` (a tensor the prune would not know
/// how to cut); quantized ones are refused.
fn module_tensors(
    staged: &Staged,
    module: &str,
    needed: &[&str],
    known: &[&str],
    what: &str,
) -> std::result::Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for name in staged.names() {
        if let Some(suffix) = name.strip_prefix(&format!("{module}.")) {
            out.insert(suffix.to_string(), name.clone());
        }
    }
    if let Some(missing) = needed.iter().find(|n| !out.contains_key(**n)) {
        return Err(format!(
            "`{module}` is not {what} (it has no `{module}.{missing}`)"
        ));
    }
    for name in out.values() {
        staged.refuse_quantized(name)?;
    }
    for (suffix, name) in &out {
        if !known.contains(&suffix.as_str()) {
            return Err(format!(
                "`{name}`: the prune does not know how to cut this tensor (it handles {})",
                known.join(", ")
            ));
        }
    }
    Ok(out)
}

/// Checks a module-wide prune reaches every layer: the config has one value for all of them.
fn every_layer(modules: &[String], cfg: &Value, key: &str) -> std::result::Result<(), String> {
    let layers = config_int(cfg, "num_hidden_layers")?;
    if modules.len() as i64 != layers {
        return Err(format!(
            "matches {} module(s) ({}) but the model has {layers} layers: config.json has one `{key}` for every layer, so the prune must cover all of them",
            modules.len(),
            modules.join(", ")
        ));
    }
    Ok(())
}

/// Runs one `prune` rule on `staged` and updates `cfg` to the pruned shapes; returns what it
/// did.
fn prune_structure(
    prune: &Prune,
    matcher: &Regex,
    staged: &mut Staged,
    cfg: &mut Value,
) -> std::result::Result<String, String> {
    let modules = matched_modules(staged, matcher);
    if modules.is_empty() {
        return Err("matches no module of the model".into());
    }
    match prune {
        Prune::Heads(heads) => prune_heads(heads, &modules, staged, cfg),
        Prune::Rows(rows) => prune_rows(rows, &modules, staged, cfg),
        Prune::Layers(layers) => prune_layers(layers, &modules, staged, cfg),
    }
}

fn prune_heads(
    heads: &[i64],
    modules: &[String],
    staged: &mut Staged,
    cfg: &mut Value,
) -> std::result::Result<String, String> {
    const KNOWN: &[&str] = &[
        "q_proj.weight",
        "q_proj.bias",
        "k_proj.weight",
        "k_proj.bias",
        "v_proj.weight",
        "v_proj.bias",
        "o_proj.weight",
        "o_proj.bias",
        "q_norm.weight",
        "k_norm.weight",
        "sinks",
    ];
    let nq = config_int(cfg, "num_attention_heads")?;
    let nkv = match cfg.get("num_key_value_heads") {
        Some(Value::Null) | None => nq,
        Some(_) => config_int(cfg, "num_key_value_heads")?,
    };
    let head_dim = match cfg.get("head_dim") {
        Some(Value::Null) | None => config_int(cfg, "hidden_size")? / nq,
        Some(_) => config_int(cfg, "head_dim")?,
    };
    let kept_q = kept_indices(nq, heads, "head")?;
    if nkv <= 0 || nq % nkv != 0 {
        return Err(format!(
            "num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}"
        ));
    }
    // Query heads g·r .. (g+1)·r − 1 share key/value head g; only whole groups can go.
    let per_group = nq / nkv;
    let groups: BTreeSet<i64> = heads.iter().map(|h| h / per_group).collect();
    for &g in &groups {
        let members = g * per_group..(g + 1) * per_group;
        if !members.clone().all(|h| heads.contains(&h)) {
            return Err(format!(
                "heads {heads:?} split key/value group {g} (query heads {}..={} share one key/value head): prune whole groups",
                members.start,
                members.end - 1
            ));
        }
    }
    let groups: Vec<i64> = groups.into_iter().collect();
    let kept_kv = kept_indices(nkv, &groups, "key/value head")?;
    every_layer(modules, cfg, "num_attention_heads")?;
    let q_rows = expand(&kept_q, head_dim);
    let kv_rows = expand(&kept_kv, head_dim);
    for module in modules {
        let tensors = module_tensors(
            staged,
            module,
            &["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"],
            KNOWN,
            "an attention module with separate q_proj, k_proj, v_proj and o_proj (fused or latent attention cannot be pruned by heads)",
        )?;
        for (suffix, name) in &tensors {
            let a = staged.get(name)?;
            let cut = match suffix.as_str() {
                "q_proj.weight" | "q_proj.bias" => keep_along(name, &a, 0, nq * head_dim, &q_rows)?,
                "k_proj.weight" | "k_proj.bias" | "v_proj.weight" | "v_proj.bias" => {
                    keep_along(name, &a, 0, nkv * head_dim, &kv_rows)?
                }
                "o_proj.weight" => keep_along(name, &a, 1, nq * head_dim, &q_rows)?,
                "sinks" => keep_along(name, &a, 0, nq, &kept_q)?,
                // o_proj's bias and the per-head-dim norms keep their shapes.
                _ => continue,
            };
            staged.set(name.clone(), cut);
        }
    }
    cfg["num_attention_heads"] = Value::from(kept_q.len());
    cfg["num_key_value_heads"] = Value::from(kept_kv.len());
    cfg["head_dim"] = Value::from(head_dim);
    Ok(format!(
        "removed heads {heads:?} from {} attention modules: {nq} → {} query heads, {nkv} → {} key/value heads",
        modules.len(),
        kept_q.len(),
        kept_kv.len()
    ))
}

fn prune_rows(
    rows: &[i64],
    modules: &[String],
    staged: &mut Staged,
    cfg: &mut Value,
) -> std::result::Result<String, String> {
    const KNOWN: &[&str] = &[
        "gate_proj.weight",
        "gate_proj.bias",
        "up_proj.weight",
        "up_proj.bias",
        "down_proj.weight",
        "down_proj.bias",
    ];
    let inter = config_int(cfg, "intermediate_size")?;
    let keep = kept_indices(inter, rows, "MLP channel")?;
    every_layer(modules, cfg, "intermediate_size")?;
    for module in modules {
        let tensors = module_tensors(
            staged,
            module,
            &["up_proj.weight", "down_proj.weight"],
            KNOWN,
            "a dense MLP with up_proj and down_proj (expert MLPs cannot be pruned by rows)",
        )?;
        for (suffix, name) in &tensors {
            let a = staged.get(name)?;
            let cut = match suffix.as_str() {
                "gate_proj.weight" | "gate_proj.bias" | "up_proj.weight" | "up_proj.bias" => {
                    keep_along(name, &a, 0, inter, &keep)?
                }
                "down_proj.weight" => keep_along(name, &a, 1, inter, &keep)?,
                _ => continue,
            };
            staged.set(name.clone(), cut);
        }
    }
    cfg["intermediate_size"] = Value::from(keep.len());
    Ok(format!(
        "removed {} MLP channels from {} modules: intermediate_size {inter} → {}",
        rows.len(),
        modules.len(),
        keep.len()
    ))
}

/// Config keys that place layers by position other than the per-layer lists this prune
/// updates: removing a layer would silently move what they describe.
fn positional_config_key(cfg: &Value) -> Option<&'static str> {
    const PRESENT: &[&str] = &[
        "sliding_window_pattern",
        "_sliding_window_pattern",
        "moe_layers",
        "is_moe_layer",
        "hybrid_override_pattern",
        "block_types",
        "attn_layer_period",
        "attn_layer_offset",
        "full_attention_interval",
        "global_attn_every_n_layers",
        "no_rope_layer_interval",
        "expert_interval",
    ];
    let int = |k: &str| cfg.get(k).and_then(Value::as_i64);
    PRESENT
        .iter()
        .copied()
        .find(|k| cfg.get(*k).is_some_and(|v| !v.is_null()))
        .or_else(|| {
            [
                "decoder_sparse_step",
                "moe_layer_freq",
                "interleave_moe_layer_step",
            ]
            .into_iter()
            .find(|k| int(k).is_some_and(|v| v > 1))
        })
        .or_else(|| {
            (int("first_k_dense_replace").is_some_and(|v| v > 0)).then_some("first_k_dense_replace")
        })
        .or_else(|| {
            cfg.get("mlp_only_layers")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
                .then_some("mlp_only_layers")
        })
        .or_else(|| {
            (cfg.get("use_sliding_window") == Some(&Value::Bool(true))
                && cfg.get("max_window_layers").is_some())
            .then_some("max_window_layers")
        })
}

/// Families whose sliding/global (or chunked, no-RoPE) layers follow the layer index when
/// `config.json` has no `layer_types`.
const INDEX_PATTERNED: &[&str] = &[
    "gemma2",
    "gemma3",
    "gemma3_text",
    "cohere2",
    "olmo3",
    "exaone4",
    "gpt_oss",
    "llama4",
    "llama4_text",
    "smollm3",
];

/// Per-layer lists of `config.json` that follow the layers.
const PER_LAYER_LISTS: &[&str] = &["layer_types", "no_rope_layers"];

fn prune_layers(
    layers: &[i64],
    modules: &[String],
    staged: &mut Staged,
    cfg: &mut Value,
) -> std::result::Result<String, String> {
    let n = config_int(cfg, "num_hidden_layers")?;
    let list = match modules {
        [one] => one.clone(),
        _ => {
            return Err(format!(
                "matches {} modules ({}): give the layer list itself, e.g. `model.layers`",
                modules.len(),
                modules.join(", ")
            ))
        }
    };
    let names = staged.names();
    for i in 0..n {
        let prefix = format!("{list}.{i}.");
        if !names.iter().any(|name| name.starts_with(&prefix)) {
            return Err(format!(
                "`{list}` is not the decoder's layer list: it has no layer {i} (num_hidden_layers is {n})"
            ));
        }
    }
    let keep = kept_indices(n, layers, "layer")?;
    if let Some(key) = positional_config_key(cfg) {
        return Err(format!(
            "config.json's `{key}` places layers by position, which removing layers would move"
        ));
    }
    let model_type = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    if INDEX_PATTERNED.contains(&model_type) && cfg.get("layer_types").is_none() {
        return Err(format!(
            "`{model_type}` places its layer kinds by index when config.json has no `layer_types`, which removing layers would move"
        ));
    }
    let mut lists = Vec::new();
    for key in PER_LAYER_LISTS {
        if let Some(v) = cfg.get(*key) {
            match v.as_array() {
                Some(a) if a.len() as i64 == n => {
                    let kept: Vec<Value> = keep.iter().map(|&i| a[i as usize].clone()).collect();
                    lists.push((*key, Value::Array(kept)));
                }
                _ => {
                    return Err(format!(
                        "config.json's `{key}` is not a list of {n} entries (one per layer)"
                    ))
                }
            }
        }
    }
    // Each layer's tensors by index; every one is removed, the kept ones come back renumbered.
    let mut by_layer: BTreeMap<i64, Vec<(String, Array)>> = BTreeMap::new();
    for name in &names {
        let Some(rest) = name.strip_prefix(&format!("{list}.")) else {
            continue;
        };
        let Some((index, suffix)) = rest.split_once('.') else {
            continue;
        };
        let Ok(index) = index.parse::<i64>() else {
            continue;
        };
        if index < n {
            by_layer
                .entry(index)
                .or_default()
                .push((suffix.to_string(), staged.get(name)?));
            staged.remove(name);
        }
    }
    for (new, old) in keep.iter().enumerate() {
        for (suffix, a) in by_layer.remove(old).unwrap_or_default() {
            staged.set(format!("{list}.{new}.{suffix}"), a);
        }
    }
    cfg["num_hidden_layers"] = Value::from(keep.len());
    for (key, v) in lists {
        cfg[key] = v;
    }
    Ok(format!(
        "removed layers {layers:?} of `{list}`: {n} → {} layers, renumbered",
        keep.len()
    ))
}

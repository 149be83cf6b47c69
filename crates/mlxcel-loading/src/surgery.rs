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
//! - op: prune                 # zero rows / columns (shape kept)
//!   glob: 'model.layers.1.mlp.down_proj.weight'
//!   rows: [0, 5]
//!   cols: [3]
//! - op: replace               # the tensor from another safetensors file (same shape and dtype)
//!   glob: 'lm_head.weight'
//!   file: other.safetensors   # relative to this YAML's folder, or absolute
//! - op: interpolate           # (1 - t) * this + t * the same-named tensor of another checkpoint
//!   glob: 'model.layers.*.self_attn.*.weight'
//!   checkpoint: ../other-model
//!   t: 0.25
//! ```
//!
//! A rule that matches nothing, a shape or dtype mismatch, a missing file, a quantized or
//! integer target, or a non-finite result is an error naming the rule (1-based), its op and
//! target. Every rule is computed first; the map is only changed once all succeeded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlxcel_arch::ModelError;
use mlxcel_core::{Array, Dtype, WeightMap};
use regex::Regex;
use serde::Deserialize;

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
    Prune {
        rows: Vec<i64>,
        cols: Vec<i64>,
    },
    Replace {
        file: PathBuf,
        tensor: Option<String>,
    },
    Interpolate {
        checkpoint: PathBuf,
        t: f64,
    },
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
                "prune" => &["rows", "cols"],
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
                    let rows = r.rows.clone().unwrap_or_default();
                    let cols = r.cols.clone().unwrap_or_default();
                    if rows.is_empty() && cols.is_empty() {
                        return Err(bad("needs `rows` or `cols` (lists of indices)".into()));
                    }
                    Edit::Prune { rows, cols }
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

    /// Applies every rule in order to `weights`. All results are computed (and checked) first;
    /// `weights` is only changed when every rule succeeded. Returns one line per rule saying
    /// what it did.
    pub fn apply(&self, weights: &mut WeightMap) -> mlxcel_arch::Result<Vec<String>> {
        let mut staged: BTreeMap<String, Array> = BTreeMap::new();
        let mut applied = Vec::with_capacity(self.rules.len());
        for rule in &self.rules {
            let fail = |msg: String| {
                ModelError::Transform(format!(
                    "surgery {}: {}: {msg}",
                    self.path.display(),
                    rule.label()
                ))
            };
            let core = |e: mlxcel_core::Error| fail(e.to_string());
            let names: Vec<String> = weights
                .names()
                .filter(|n| rule.matcher.is_match(n))
                .map(str::to_string)
                .collect();
            if names.is_empty() {
                return Err(fail("matches no tensor of the model".into()));
            }
            let source = match &rule.edit {
                Edit::AddFile { file, .. } | Edit::Replace { file, .. } => {
                    Some(WeightMap::open_file(file).map_err(core)?)
                }
                Edit::Interpolate { checkpoint, .. } => {
                    Some(WeightMap::open(checkpoint).map_err(core)?)
                }
                _ => None,
            };
            let named = match &rule.edit {
                Edit::AddFile { tensor, .. } | Edit::Replace { tensor, .. } => tensor.clone(),
                _ => None,
            };
            if named.is_some() && names.len() != 1 {
                return Err(fail(format!(
                    "`tensor` names one source tensor but the target matches {} tensors",
                    names.len()
                )));
            }
            for name in &names {
                if let Some(base) = name.strip_suffix(".weight") {
                    if weights.contains(&format!("{base}.scales")) {
                        return Err(fail(format!(
                            "`{name}` is quantized (it has a `.scales` sibling): surgery on quantized weights is not supported yet"
                        )));
                    }
                }
                let current = match staged.get(name) {
                    Some(a) => a.clone(),
                    None => weights.get(name).map_err(core)?,
                };
                let dtype = current.dtype().map_err(core)?;
                if !dtype.is_float() {
                    return Err(fail(format!(
                        "`{name}` has dtype {dtype}: only floating-point tensors can be edited (quantized weights are not supported yet)"
                    )));
                }
                let shape = current.shape();
                // The other tensor (add from a file, replace, interpolate): same shape and dtype.
                let other = match &source {
                    Some(src) => {
                        let from = named.as_deref().unwrap_or(name);
                        let what = match &rule.edit {
                            Edit::Interpolate { checkpoint, .. } => {
                                checkpoint.display().to_string()
                            }
                            Edit::AddFile { file, .. } | Edit::Replace { file, .. } => {
                                file.display().to_string()
                            }
                            _ => String::new(),
                        };
                        let o = src.get(from).map_err(|_| {
                            fail(format!("{what} has no tensor `{from}` (for `{name}`)"))
                        })?;
                        if o.shape() != shape {
                            return Err(fail(format!(
                                "shape mismatch: `{name}` is {shape:?} but `{from}` in {what} is {:?}",
                                o.shape()
                            )));
                        }
                        let od = o.dtype().map_err(core)?;
                        if od != dtype {
                            return Err(fail(format!(
                                "dtype mismatch: `{name}` is {dtype} but `{from}` in {what} is {od}"
                            )));
                        }
                        Some(o)
                    }
                    None => None,
                };
                let new = edit_tensor(&rule.edit, &current, other.as_ref(), &shape)
                    .map_err(|e| match e {
                        EditError::Core(e) => core(e),
                        EditError::Msg(m) => fail(format!("`{name}`: {m}")),
                    })?
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
                    return Err(fail(format!(
                        "the result for `{name}` is not finite (inf or NaN)"
                    )));
                }
                staged.insert(name.clone(), new);
            }
            applied.push(format!(
                "surgery rule {}: {} `{}` on {} tensor{}",
                rule.index,
                rule.op,
                rule.target,
                names.len(),
                if names.len() == 1 { "" } else { "s" }
            ));
        }
        for (name, array) in staged {
            weights.insert(name, array)?;
        }
        Ok(applied)
    }
}

enum EditError {
    Core(mlxcel_core::Error),
    Msg(String),
}

impl From<mlxcel_core::Error> for EditError {
    fn from(e: mlxcel_core::Error) -> Self {
        EditError::Core(e)
    }
}

/// A 0/1 mask over `len` entries with `zero` set to 0; indices out of range are an error.
fn mask(len: i32, zero: &[i64], what: &str) -> std::result::Result<Vec<f32>, EditError> {
    let mut m = vec![1.0f32; len as usize];
    for &i in zero {
        if i < 0 || i >= len as i64 {
            return Err(EditError::Msg(format!(
                "{what} index {i} is out of range (the dimension has {len})"
            )));
        }
        m[i as usize] = 0.0;
    }
    Ok(m)
}

fn edit_tensor(
    edit: &Edit,
    current: &Array,
    other: Option<&Array>,
    shape: &[i32],
) -> std::result::Result<Array, EditError> {
    let x = current.astype(Dtype::Float32)?;
    let other32 = || -> std::result::Result<Array, EditError> {
        match other {
            Some(o) => Ok(o.astype(Dtype::Float32)?),
            None => Err(EditError::Msg("no source tensor".into())),
        }
    };
    Ok(match edit {
        Edit::Scale(f) => x.mul_scalar(*f)?,
        Edit::AddValue(v) => x.add_scalar(*v)?,
        Edit::AddFile { .. } => x.add(&other32()?)?,
        Edit::Replace { .. } => other32()?,
        Edit::Interpolate { t, .. } => x.mul_scalar(1.0 - t)?.add(&other32()?.mul_scalar(*t)?)?,
        Edit::Prune { rows, cols } => {
            let mut y = x;
            if !rows.is_empty() {
                let n = shape
                    .first()
                    .copied()
                    .ok_or_else(|| EditError::Msg("a scalar has no rows to prune".to_string()))?;
                let mut mshape = vec![1i32; shape.len()];
                mshape[0] = n;
                let m = Array::from_slice(&mask(n, rows, "row")?, &mshape)?;
                y = y.multiply(&m)?;
            }
            if !cols.is_empty() {
                if shape.len() != 2 {
                    return Err(EditError::Msg(format!(
                        "`cols` needs a 2-D tensor, this one has shape {shape:?}"
                    )));
                }
                let m = Array::from_slice(&mask(shape[1], cols, "column")?, &[1, shape[1]])?;
                y = y.multiply(&m)?;
            }
            y
        }
    })
}

//! A llama/qwen2/qwen3-architecture GGUF → an MLX checkpoint folder.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use half::f16;
use mlxcel_core::{Array, Dtype};
use serde_json::{json, Map, Value};

use super::arch::{is_split_kv_b, join_kv_b, meta_f64, meta_u64, Arch, ArchParams};
use super::blocks::{self, AffinePlanes, MlxMapping, RepackError, Requantized};
use super::reader::{GgufFile, GgufTensorInfo};
use super::rope_freqs::{reconstruct_llama3, ROPE_FREQS};
use super::tokenizer::build_tokenizer_files;
use super::types::GgmlType;
use super::GgufError;

/// How one GGUF tensor was imported.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorImport {
    /// The tensor's name in the GGUF (`blk.3.attn_q.weight`).
    pub gguf_name: String,
    /// The name it was written under (`model.layers.3.self_attn.q_proj.weight`).
    pub hf_name: String,
    /// Its type in the GGUF.
    pub ggml_type: GgmlType,
    /// `Some((bits, group_size))` when repacked losslessly into MLX affine planes.
    pub affine: Option<(i32, i32)>,
    /// Whether the rows were un-permuted (llama.cpp's rope permutation of `attn_q`/`attn_k`).
    pub unpermuted: bool,
    /// Set when the type has no exact MLX form and was re-quantized: the error it added.
    pub requantized: Option<Requantized>,
}

/// What [`import_gguf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportReport {
    /// Every tensor imported, in GGUF order.
    pub tensors: Vec<TensorImport>,
    /// The `config.json` written.
    pub config: Value,
}

impl ImportReport {
    /// One line per GGUF type that had to be re-quantized (no exact MLX form): the MLX format,
    /// how many tensors, and the largest weight error (absolute, and relative to that tensor's
    /// max |w|). Empty when every tensor was imported exactly.
    pub fn requantization_notes(&self) -> Vec<String> {
        let mut by_type: BTreeMap<&str, (i32, usize, f32, f32)> = BTreeMap::new();
        for t in &self.tensors {
            if let (Some(err), Some((bits, _))) = (t.requantized, t.affine) {
                let e = by_type
                    .entry(t.ggml_type.name())
                    .or_insert((bits, 0, 0.0, 0.0));
                e.1 += 1;
                e.2 = e.2.max(err.max_abs_error);
                e.3 = e.3.max(err.relative());
            }
        }
        by_type
            .into_iter()
            .map(|(ty, (bits, n, abs, rel))| {
                format!(
                    "{ty}: {n} tensors re-quantized to MLX affine {bits}-bit, group 32 (no exact \
                     MLX form): max |Δw| {abs:.2e}, at most {:.3}% of a tensor's max |w|",
                    rel * 100.0
                )
            })
            .collect()
    }
}

/// The HF llama name of a GGUF tensor (`blk.3.attn_q.weight` →
/// `model.layers.3.self_attn.q_proj.weight`), or `None` for names without one.
pub fn hf_tensor_name(gguf: &str) -> Option<String> {
    Arch::find("llama")?.hf_name(gguf)
}

/// Undoes llama.cpp's rope permutation of Q/K projection rows.
///
/// llama.cpp's converter stores HF rows permuted as
/// `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)`, so GGUF row
/// `h·d + 2j + i` is HF row `h·d + i·d/2 + j` (`d = rows / n_head`). `data` holds `rows` rows of
/// equal length (any element type: packed words, scales, biases, floats, raw bytes); whole rows
/// move, so this is lossless for every plane.
pub fn unpermute_rope_rows<T: Copy>(data: &[T], rows: usize, n_head: usize) -> Option<Vec<T>> {
    if rows == 0 || n_head == 0 || rows % (2 * n_head) != 0 || data.len() % rows != 0 {
        return None;
    }
    let row_len = data.len() / rows;
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(data.len());
    for hf_row in 0..rows {
        let (h, r) = (hf_row / head_dim, hf_row % head_dim);
        let (i, j) = (r / half, r % half);
        let src = h * head_dim + 2 * j + i;
        out.extend_from_slice(&data[src * row_len..(src + 1) * row_len]);
    }
    Some(out)
}

/// The GGUF architectures [`import_gguf`] reads (`general.architecture`); the `arch` module
/// docs say what each needs undone.
pub const SUPPORTED_ARCHITECTURES: [&str; 10] = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen2moe",
    "qwen3moe",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "deepseek2",
];

/// The hyper-parameters read from `<arch>.*` metadata.
struct LlamaParams {
    arch: &'static Arch,
    n_layer: u64,
    n_embd: u64,
    n_ff: u64,
    n_head: u64,
    n_head_kv: u64,
    n_ctx: u64,
    rms_eps: f64,
    rope_theta: f64,
    head_dim: Option<u64>,
    rope_scaling: Option<Value>,
}

fn required<T>(g: &GgufFile, key: &str, v: Option<T>) -> Result<T, GgufError> {
    v.ok_or_else(|| GgufError::metadata(g.path(), key, "missing"))
}

fn llama_params(g: &GgufFile) -> Result<LlamaParams, GgufError> {
    let arch_key = "general.architecture";
    let name = g
        .get(arch_key)
        .and_then(|v| v.as_str())
        .ok_or_else(|| GgufError::metadata(g.path(), arch_key, "missing or not a string"))?;
    let arch = Arch::of_file(g, name)?.ok_or_else(|| {
        GgufError::metadata(
            g.path(),
            arch_key,
            format!(
                "architecture `{name}` cannot be imported yet (supported: {})",
                SUPPORTED_ARCHITECTURES.join(", ")
            ),
        )
    })?;
    let k = |s: &str| format!("{name}.{s}");
    let u = |s: &str| -> Result<u64, GgufError> {
        let key = k(s);
        required(g, &key, meta_u64(g, &key)?)
    };
    let n_head = u("attention.head_count")?;
    let rope_scaling = match g.get(&k("rope.scaling.type")).map(|v| v.as_str()) {
        None | Some(Some("none")) => None,
        Some(Some("linear")) => {
            let key = k("rope.scaling.factor");
            let factor = required(g, &key, meta_f64(g, &key)?)?;
            Some(json!({"type": "linear", "factor": factor}))
        }
        Some(other) => {
            return Err(GgufError::metadata(
                g.path(),
                &k("rope.scaling.type"),
                format!("rope scaling {other:?} is not supported (only `linear`)"),
            ))
        }
    };
    let n_embd = u("embedding_length")?;
    let n_ctx = u("context_length")?;
    let rope_theta = meta_f64(g, &k("rope.freq_base"))?.unwrap_or(10000.0);
    let head_dim = meta_u64(g, &k("attention.key_length"))?;
    let rope_scaling = match (rope_scaling, g.tensor(ROPE_FREQS)) {
        (scaling, None) => scaling,
        (None, Some(info)) => {
            let original_ctx = meta_u64(g, &k("rope.scaling.original_context_length"))?;
            let dim = head_dim.unwrap_or(n_embd / n_head.max(1));
            let factors =
                blocks::dequantize(info.ggml_type, g.tensor_data(info)?).ok_or_else(|| {
                    GgufError::tensor(g.path(), ROPE_FREQS, "its type cannot be decoded")
                })?;
            let p = reconstruct_llama3(&factors, rope_theta, dim, n_ctx, original_ctx).map_err(
                |e| GgufError::tensor(g.path(), ROPE_FREQS, format!("llama3 rope factors: {e}")),
            )?;
            Some(p.to_json())
        }
        (Some(_), Some(_)) => {
            return Err(GgufError::tensor(
                g.path(),
                ROPE_FREQS,
                "rope frequency factors on top of `rope.scaling.type` are not supported",
            ))
        }
    };
    Ok(LlamaParams {
        arch,
        n_layer: u("block_count")?,
        n_embd,
        n_ff: u("feed_forward_length")?,
        n_head,
        n_head_kv: meta_u64(g, &k("attention.head_count_kv"))?.unwrap_or(n_head),
        n_ctx,
        rms_eps: {
            let key = k("attention.layer_norm_rms_epsilon");
            required(g, &key, meta_f64(g, &key)?)?
        },
        rope_theta,
        head_dim,
        rope_scaling,
    })
}

fn to_i32(g: &GgufFile, tensor: &str, v: u64) -> Result<i32, GgufError> {
    i32::try_from(v)
        .map_err(|_| GgufError::tensor(g.path(), tensor, format!("dimension {v} exceeds i32")))
}

/// One imported tensor's arrays, keyed by their safetensors names.
struct Converted {
    arrays: Vec<(String, Array)>,
    record: TensorImport,
}

fn convert_tensor(
    g: &GgufFile,
    info: &GgufTensorInfo,
    params: &LlamaParams,
) -> Result<Converted, GgufError> {
    let path = g.path();
    let name = &info.name;
    let hf_name = params.arch.hf_name(name).ok_or_else(|| {
        GgufError::tensor(
            path,
            name,
            format!("no HF name is known for this {} tensor", params.arch.gguf),
        )
    })?;
    let bytes = g.tensor_data(info)?;
    let shape: Vec<i32> = info
        .torch_shape()
        .iter()
        .map(|d| to_i32(g, name, *d))
        .collect::<Result<_, _>>()?;
    let cols = info.ne[0] as usize;
    // Stacked experts (`[experts, out, in]`) are `experts · out` rows of `in`.
    let rows = (info.numel() as usize).checked_div(cols).unwrap_or(0);

    // llama's Q and K projections (weights and biases) come rope-permuted; llama.cpp's
    // converter leaves qwen2/qwen3 (NeoX-style rope) as they are.
    let permute_heads = if !params.arch.rope_permuted {
        None
    } else if name.contains(".attn_q.") {
        Some(params.n_head)
    } else if name.contains(".attn_k.") {
        Some(params.n_head_kv)
    } else {
        None
    };
    // A 1-D bias is one "row" per element along the output axis.
    let perm_rows = if info.ne.len() == 1 { cols } else { rows };
    let perm = |n_rows: usize| -> Result<Option<usize>, GgufError> {
        match permute_heads {
            None => Ok(None),
            Some(h) if h > 0 && n_rows % (2 * h as usize) == 0 => Ok(Some(h as usize)),
            Some(h) => Err(GgufError::tensor(
                path,
                name,
                format!("{n_rows} rows do not split into {h} rope heads of even size"),
            )),
        }
    };
    let heads = perm(perm_rows)?;
    let apply = |v: &[u8], n_rows: usize| -> Result<Vec<u8>, GgufError> {
        match heads {
            None => Ok(v.to_vec()),
            Some(h) => unpermute_rope_rows(v, n_rows, h).ok_or_else(|| {
                GgufError::tensor(path, name, "row count does not match the rope head layout")
            }),
        }
    };
    fn permute_vec<T: Copy>(
        v: Vec<T>,
        n_rows: usize,
        heads: Option<usize>,
        path: &Path,
        name: &str,
    ) -> Result<Vec<T>, GgufError> {
        match heads {
            None => Ok(v),
            Some(h) => unpermute_rope_rows(&v, n_rows, h).ok_or_else(|| {
                GgufError::tensor(path, name, "row count does not match the rope head layout")
            }),
        }
    }
    let mlx = |e: mlxcel_core::Error| GgufError::mlx(path, e);

    let mut record = TensorImport {
        gguf_name: name.clone(),
        hf_name: hf_name.clone(),
        ggml_type: info.ggml_type,
        affine: None,
        unpermuted: heads.is_some(),
        requantized: None,
    };

    let ty = info.ggml_type;
    let arrays = match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            let dtype = match ty {
                GgmlType::F32 => Dtype::Float32,
                GgmlType::F16 => Dtype::Float16,
                _ => Dtype::Bfloat16,
            };
            if params.arch.offset_norm(&hf_name) {
                // Stored as 1 + w: written back as w in float32.
                let values = blocks::dequantize(ty, bytes).unwrap_or_default();
                let values: Vec<f32> = values.iter().map(|v| v - 1.0).collect();
                vec![(
                    hf_name,
                    Array::from_slice::<f32>(&values, &shape).map_err(mlx)?,
                )]
            } else {
                let data = apply(bytes, perm_rows)?;
                vec![(
                    hf_name,
                    Array::from_bytes(&data, &shape, dtype).map_err(mlx)?,
                )]
            }
        }
        _ if info.ne.len() >= 2
            && !is_split_kv_b(&hf_name)
            && matches!(
                blocks::mlx_mapping(ty),
                MlxMapping::Lossless { .. } | MlxMapping::Requantized { .. }
            ) =>
        {
            let planes = blocks::repack_affine(ty, bytes).map_err(|e| match e {
                RepackError::NotAffine => GgufError::UnsupportedType {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    ggml_type: ty,
                },
                RepackError::BiasOverflow { block, scale } => GgufError::tensor(
                    path,
                    name,
                    format!("block {block}: scale {scale} gives a bias beyond float16 range"),
                ),
            })?;
            let AffinePlanes {
                bits,
                group_size,
                weight,
                scales,
                biases,
                f32_scales,
                requantized,
            } = planes;
            let words = cols * bits as usize / 32;
            let groups = cols / group_size as usize;
            let weight = permute_vec(weight, rows, heads, path, name)?;
            let scales = permute_vec(scales, rows, heads, path, name)?;
            let biases = permute_vec(biases, rows, heads, path, name)?;
            // The planes keep the leading axes (`[out]`, or `[experts, out]`) and replace the
            // last: `in` elements become `words` words and `groups` scales.
            let lead = &shape[..shape.len() - 1];
            let module = hf_name
                .strip_suffix(".weight")
                .unwrap_or(&hf_name)
                .to_string();
            record.affine = Some((bits, group_size));
            record.requantized = requantized;
            let groups = to_i32(g, name, groups as u64)?;
            // Float16 holds the scales of the types that allow it exactly (see `blocks`).
            let plane = |v: &[f32]| -> Result<Array, GgufError> {
                let shape: Vec<i32> = lead.iter().copied().chain([groups]).collect();
                if f32_scales {
                    Array::from_slice::<f32>(v, &shape).map_err(mlx)
                } else {
                    let h: Vec<f16> = v.iter().map(|x| f16::from_f32(*x)).collect();
                    Array::from_slice::<f16>(&h, &shape).map_err(mlx)
                }
            };
            vec![
                (
                    format!("{module}.weight"),
                    Array::from_slice::<u32>(&weight, &{
                        let words = to_i32(g, name, words as u64)?;
                        lead.iter().copied().chain([words]).collect::<Vec<_>>()
                    })
                    .map_err(mlx)?,
                ),
                (format!("{module}.scales"), plane(&scales)?),
                (format!("{module}.biases"), plane(&biases)?),
            ]
        }
        _ => {
            let values =
                blocks::dequantize(ty, bytes).ok_or_else(|| GgufError::UnsupportedType {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    ggml_type: ty,
                })?;
            let mut values = permute_vec(values, perm_rows, heads, path, name)?;
            if params.arch.offset_norm(&hf_name) {
                values.iter_mut().for_each(|v| *v -= 1.0);
            }
            vec![(
                hf_name,
                Array::from_slice::<f32>(&values, &shape).map_err(mlx)?,
            )]
        }
    };
    Ok(Converted { arrays, record })
}

/// Replaces each layer's `self_attn.k_b_proj`/`v_b_proj` pair (DeepSeek MLA, split by llama.cpp)
/// with the `kv_b_proj` they came from.
fn join_split_kv_b(g: &GgufFile, tensors: &mut Vec<(String, Array)>) -> Result<(), GgufError> {
    let path = g.path();
    let mlx = |e: mlxcel_core::Error| GgufError::mlx(path, e);
    let k_names: Vec<String> = tensors
        .iter()
        .map(|(n, _)| n.clone())
        .filter(|n| n.ends_with("self_attn.k_b_proj.weight"))
        .collect();
    for k_name in k_names {
        let prefix = k_name.trim_end_matches("k_b_proj.weight");
        let v_name = format!("{prefix}v_b_proj.weight");
        let take = |tensors: &mut Vec<(String, Array)>, name: &str| {
            let at = tensors.iter().position(|(n, _)| n == name)?;
            Some(tensors.remove(at).1)
        };
        let k = take(tensors, &k_name);
        let v = take(tensors, &v_name)
            .ok_or_else(|| GgufError::format(path, format!("`{k_name}` has no `{v_name}`")))?;
        let k = k.ok_or_else(|| GgufError::format(path, format!("`{k_name}` vanished")))?;
        let f32s = |a: &Array| a.astype(Dtype::Float32)?.to_vec::<f32>();
        let (kv, kshape) = (f32s(&k).map_err(mlx)?, k.shape());
        let (vv, vshape) = (f32s(&v).map_err(mlx)?, v.shape());
        let (joined, shape) = join_kv_b((&kv, &kshape), (&vv, &vshape)).ok_or_else(|| {
            GgufError::format(
                path,
                format!(
                    "`{k_name}` {kshape:?} and `{v_name}` {vshape:?} do not join into kv_b_proj"
                ),
            )
        })?;
        tensors.push((
            format!("{prefix}kv_b_proj.weight"),
            Array::from_slice::<f32>(&joined, &shape).map_err(mlx)?,
        ));
    }
    Ok(())
}

/// The `quantization` block mlx-lm writes: the most common `(bits, group_size)` as the default,
/// and an entry per module path whose width differs. `None` when nothing is quantized.
fn quantization_block(records: &[TensorImport]) -> Option<Value> {
    let mut counts: BTreeMap<(i32, i32), usize> = BTreeMap::new();
    for r in records {
        if let Some(spec) = r.affine {
            *counts.entry(spec).or_default() += 1;
        }
    }
    // Most tensors win; ties go to the wider format (deterministic either way).
    let (&(bits, group_size), _) = counts.iter().max_by_key(|(spec, n)| (**n, **spec))?;
    let mut q = Map::new();
    q.insert("group_size".into(), json!(group_size));
    q.insert("bits".into(), json!(bits));
    q.insert("mode".into(), json!("affine"));
    for r in records {
        if let Some((b, gs)) = r.affine {
            if (b, gs) != (bits, group_size) {
                let module = r.hf_name.strip_suffix(".weight").unwrap_or(&r.hf_name);
                q.insert(
                    module.to_string(),
                    json!({"group_size": gs, "bits": b, "mode": "affine"}),
                );
            }
        }
    }
    Some(Value::Object(q))
}

fn one_or_many(ids: &[u64]) -> Value {
    match ids {
        [one] => json!(one),
        many => json!(many),
    }
}

fn write_json(path: &Path, value: &Value) -> Result<(), GgufError> {
    let mut text = serde_json::to_string_pretty(value)
        .map_err(|e| GgufError::format(path, format!("serialising JSON: {e}")))?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| GgufError::io(path, e))
}

/// Imports the llama, qwen2 or qwen3 GGUF at `gguf_path` into `out_dir` (created if missing): `config.json`,
/// `model.safetensors` (metadata `{"format": "mlx"}`), `tokenizer.json`,
/// `tokenizer_config.json` and `generation_config.json`. `progress(done, total, tensor)` is
/// called after each tensor.
pub fn import_gguf(
    gguf_path: &Path,
    out_dir: &Path,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<ImportReport, GgufError> {
    let g = GgufFile::open(gguf_path)?;
    let params = llama_params(&g)?;
    std::fs::create_dir_all(out_dir).map_err(|e| GgufError::io(out_dir, e))?;

    let total = g.tensors().len();
    let mut tensors: Vec<(String, Array)> = Vec::new();
    let mut records = Vec::with_capacity(total);
    for (i, info) in g.tensors().iter().enumerate() {
        // Already turned back into `rope_scaling` by `llama_params`.
        if info.name == ROPE_FREQS {
            progress(i + 1, total, &info.name);
            continue;
        }
        let c = convert_tensor(&g, info, &params)?;
        tensors.extend(c.arrays);
        records.push(c.record);
        progress(i + 1, total, &info.name);
    }
    join_split_kv_b(&g, &mut tensors)?;
    let mut seen = HashMap::new();
    for (name, _) in &tensors {
        if seen.insert(name.clone(), ()).is_some() {
            return Err(GgufError::format(
                g.path(),
                format!("two GGUF tensors map to `{name}`"),
            ));
        }
    }
    let embed = g
        .tensor("token_embd.weight")
        .ok_or_else(|| GgufError::tensor(g.path(), "token_embd.weight", "missing from the file"))?;
    let vocab_size = match meta_u64(&g, &format!("{}.vocab_size", params.arch.gguf))? {
        Some(v) => v,
        None => embed.ne.get(1).copied().unwrap_or(0),
    };
    let tied = g.tensor("output.weight").is_none();
    let any = |t: GgmlType| records.iter().any(|r| r.ggml_type == t);
    let torch_dtype = if any(GgmlType::Bf16) {
        "bfloat16"
    } else if any(GgmlType::F16) || records.iter().any(|r| r.affine.is_some()) {
        "float16"
    } else {
        "float32"
    };

    let tok = build_tokenizer_files(&g, params.n_ctx)?;

    let mut config = Map::new();
    config.insert("architectures".into(), json!([params.arch.class]));
    config.insert("model_type".into(), json!(params.arch.model_type));
    config.insert("hidden_size".into(), json!(params.n_embd));
    config.insert("intermediate_size".into(), json!(params.n_ff));
    config.insert("num_attention_heads".into(), json!(params.n_head));
    config.insert("num_key_value_heads".into(), json!(params.n_head_kv));
    config.insert("num_hidden_layers".into(), json!(params.n_layer));
    config.insert(
        "head_dim".into(),
        json!(params
            .head_dim
            .unwrap_or(params.n_embd / params.n_head.max(1))),
    );
    config.insert("rms_norm_eps".into(), json!(params.rms_eps));
    config.insert("rope_theta".into(), json!(params.rope_theta));
    config.insert("rope_scaling".into(), json!(params.rope_scaling));
    config.insert("max_position_embeddings".into(), json!(params.n_ctx));
    config.insert("vocab_size".into(), json!(vocab_size));
    config.insert("tie_word_embeddings".into(), json!(tied));
    config.insert("hidden_act".into(), json!("silu"));
    config.insert(
        "attention_bias".into(),
        json!(g.tensors().iter().any(|t| t.name.ends_with(".attn_q.bias"))),
    );
    config.insert("mlp_bias".into(), json!(false));
    config.insert("torch_dtype".into(), json!(torch_dtype));
    if let Some(bos) = tok.bos_id {
        config.insert("bos_token_id".into(), json!(bos));
    }
    if !tok.eos_ids.is_empty() {
        config.insert("eos_token_id".into(), one_or_many(&tok.eos_ids));
    }
    let head_dim = params
        .head_dim
        .unwrap_or(params.n_embd / params.n_head.max(1));
    params.arch.config_extras(
        &g,
        &ArchParams {
            n_layer: params.n_layer,
            n_embd: params.n_embd,
            n_ff: params.n_ff,
            n_head: params.n_head,
            n_ctx: params.n_ctx,
            head_dim,
        },
        &mut config,
    )?;
    if let Some(q) = quantization_block(&records) {
        config.insert("quantization".into(), q.clone());
        config.insert("quantization_config".into(), q);
    }
    let config = Value::Object(config);

    let metadata: HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
    let st = out_dir.join("model.safetensors");
    mlxcel_core::weights::save_safetensors(&st, &tensors, Some(metadata))
        .map_err(|e| GgufError::mlx(&st, e))?;
    write_json(&out_dir.join("config.json"), &config)?;
    write_json(&out_dir.join("tokenizer.json"), &tok.tokenizer)?;
    write_json(
        &out_dir.join("tokenizer_config.json"),
        &tok.tokenizer_config,
    )?;
    let mut gen = Map::new();
    if let Some(bos) = tok.bos_id {
        gen.insert("bos_token_id".into(), json!(bos));
    }
    if !tok.eos_ids.is_empty() {
        gen.insert("eos_token_id".into(), one_or_many(&tok.eos_ids));
    }
    if let Some(pad) = tok.pad_id {
        gen.insert("pad_token_id".into(), json!(pad));
    }
    write_json(&out_dir.join("generation_config.json"), &Value::Object(gen))?;

    Ok(ImportReport {
        tensors: records,
        config,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf_llama() {
        let cases = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            (
                "blk.12.attn_q.weight",
                "model.layers.12.self_attn.q_proj.weight",
            ),
            ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
            (
                "blk.1.attn_output.weight",
                "model.layers.1.self_attn.o_proj.weight",
            ),
            (
                "blk.2.ffn_down.weight",
                "model.layers.2.mlp.down_proj.weight",
            ),
            (
                "blk.2.ffn_norm.weight",
                "model.layers.2.post_attention_layernorm.weight",
            ),
            (
                "blk.2.attn_norm.weight",
                "model.layers.2.input_layernorm.weight",
            ),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
        ];
        for (g, hf) in cases {
            assert_eq!(hf_tensor_name(g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(hf_tensor_name("rope_freqs.weight"), None);
        assert_eq!(hf_tensor_name("blk.x.attn_q.weight"), None);
    }

    /// llama.cpp's permutation written out with explicit index arithmetic, independently of
    /// `unpermute_rope_rows`: `permute(w)[h, j, i] = w[h, i, j]` over `(n_head, 2, d/2)`.
    fn llama_cpp_permute(w: &[u32], rows: usize, n_head: usize) -> Vec<u32> {
        let cols = w.len() / rows;
        let half = rows / n_head / 2;
        let mut out = vec![0; w.len()];
        for h in 0..n_head {
            for i in 0..2 {
                for j in 0..half {
                    let src = (h * 2 + i) * half + j; // w.reshape(n_head, 2, half)[h, i, j]
                    let dst = (h * half + j) * 2 + i; // swapped to (n_head, half, 2)[h, j, i]
                    out[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&w[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (rows, cols, heads) = (24, 3, 3);
        let w: Vec<u32> = (0..(rows * cols) as u32).collect();
        let p = llama_cpp_permute(&w, rows, heads);
        assert_ne!(p, w);
        assert_eq!(unpermute_rope_rows(&p, rows, heads).unwrap(), w);
        // Head 0 of the GGUF rows interleaves the two rotary halves: 0, 4, 1, 5, ...
        let first_col: Vec<u32> = p.iter().step_by(cols).take(8).map(|v| v / 3).collect();
        assert_eq!(first_col, vec![0, 4, 1, 5, 2, 6, 3, 7]);
        assert!(unpermute_rope_rows(&p, rows, 5).is_none());
    }

    #[test]
    fn quantization_block_has_overrides_for_other_widths() {
        let rec = |hf: &str, affine| TensorImport {
            gguf_name: String::new(),
            hf_name: hf.into(),
            ggml_type: GgmlType::Q4_1,
            affine,
            unpermuted: false,
            requantized: None,
        };
        let q = quantization_block(&[
            rec("model.embed_tokens.weight", Some((8, 32))),
            rec("model.layers.0.mlp.up_proj.weight", Some((4, 32))),
            rec("model.layers.0.mlp.down_proj.weight", Some((4, 32))),
            rec("model.norm.weight", None),
        ])
        .unwrap();
        assert_eq!(
            q,
            json!({"group_size": 32, "bits": 4, "mode": "affine",
                   "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}})
        );
        assert_eq!(quantization_block(&[rec("model.norm.weight", None)]), None);
    }

    use crate::gguf::blocks::tests::noise;

    /// `n` blocks of `size` bytes with an f16 scale (and min) at `scale_at` set to sane values.
    fn blocks_with(n: usize, size: usize, scale_at: &[usize], seed: u32) -> Vec<u8> {
        let mut b = noise(n * size, seed);
        for (k, blk) in b.chunks_exact_mut(size).enumerate() {
            for (i, at) in scale_at.iter().enumerate() {
                let v = f16::from_f32(0.01 * (k % 7 + 1) as f32 * if i == 1 { -1.0 } else { 1.0 });
                blk[*at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    #[test]
    fn tiny_llama_imports_end_to_end() {
        use crate::gguf::reader::tests::{build, string_value, write};
        let u32v = |v: u32| v.to_le_bytes().to_vec();
        let strings = |items: &[&str]| {
            let mut b = 8u32.to_le_bytes().to_vec();
            b.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|s| b.extend(string_value(s)));
            b
        };
        let mut types = 5u32.to_le_bytes().to_vec();
        types.extend(4u64.to_le_bytes());
        [1i32, 1, 1, 3]
            .iter()
            .for_each(|t| types.extend(t.to_le_bytes()));
        let kvs = vec![
            ("general.architecture", 8, string_value("llama")),
            ("llama.block_count", 4, u32v(1)),
            ("llama.context_length", 4, u32v(64)),
            ("llama.embedding_length", 4, u32v(32)),
            ("llama.feed_forward_length", 4, u32v(64)),
            ("llama.attention.head_count", 4, u32v(2)),
            ("llama.attention.head_count_kv", 4, u32v(1)),
            (
                "llama.attention.layer_norm_rms_epsilon",
                6,
                1e-6f32.to_le_bytes().to_vec(),
            ),
            ("tokenizer.ggml.model", 8, string_value("gpt2")),
            ("tokenizer.ggml.pre", 8, string_value("smollm")),
            (
                "tokenizer.ggml.tokens",
                9,
                strings(&["a", "b", "ab", "<|end|>"]),
            ),
            ("tokenizer.ggml.merges", 9, strings(&["a b"])),
            ("tokenizer.ggml.token_type", 9, types),
            ("tokenizer.ggml.eos_token_id", 4, u32v(3)),
            ("tokenizer.chat_template", 8, string_value("{{ messages }}")),
        ];
        let q_bytes = blocks_with(32, 20, &[0, 2], 1);
        let k_bytes: Vec<u8> = (0..16 * 32)
            .flat_map(|i| f16::from_f32(i as f32).to_le_bytes())
            .collect();
        let v_bytes = blocks_with(2, 210, &[208], 3);
        let tensors = vec![
            (
                "token_embd.weight",
                vec![32, 4],
                8,
                blocks_with(4, 34, &[0], 4),
            ),
            ("blk.0.attn_q.weight", vec![32, 32], 3, q_bytes.clone()),
            ("blk.0.attn_k.weight", vec![32, 16], 1, k_bytes),
            ("blk.0.attn_v.weight", vec![256, 2], 14, v_bytes.clone()),
            (
                "blk.0.ffn_up.weight",
                vec![32, 64],
                3,
                blocks_with(64, 20, &[0, 2], 5),
            ),
            ("output_norm.weight", vec![32], 0, vec![0; 128]),
        ];
        let f = write(&build(&kvs, &tensors, 32));
        let out = tempfile::tempdir().unwrap();
        let mut calls = 0;
        let report = import_gguf(f.path(), out.path(), &mut |_, total, _| {
            calls += 1;
            assert_eq!(total, 6);
        })
        .unwrap();
        assert_eq!(calls, 6);
        let c = &report.config;
        assert_eq!(c["num_key_value_heads"], 1);
        assert_eq!(c["rms_norm_eps"], 1e-6);
        assert_eq!(c["tie_word_embeddings"], true);
        assert_eq!(
            c["quantization"],
            // Two 8-bit tensors (Q8_0 embedding, Q6_K v_proj) and two 4-bit: the tie goes to 8.
            json!({"group_size": 32, "bits": 8, "mode": "affine",
                   "model.layers.0.self_attn.q_proj": {"group_size": 32, "bits": 4, "mode": "affine"},
                   "model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 4, "mode": "affine"}})
        );
        assert_eq!(c["quantization_config"], c["quantization"]);

        let w = mlxcel_core::WeightMap::open(out.path()).unwrap();
        // q_proj: MLX's dequantize of the repacked planes equals the GGUF decode, un-permuted.
        let pre = "model.layers.0.self_attn.q_proj";
        let f32_of = |n: &str| w.get(n).unwrap().astype(Dtype::Float32).unwrap();
        let dq = mlxcel_core::ops::dequantize(
            &w.get(&format!("{pre}.weight")).unwrap(),
            &f32_of(&format!("{pre}.scales")),
            Some(&f32_of(&format!("{pre}.biases"))),
            mlxcel_core::ops::QuantSpec::affine(32, 4),
            Some(Dtype::Float32),
        )
        .unwrap();
        let want = blocks::dequantize(GgmlType::Q4_1, &q_bytes).unwrap();
        let want = unpermute_rope_rows(&want, 32, 2).unwrap();
        assert_eq!(dq.to_vec::<f32>().unwrap(), want);
        // k_proj (F16 pass-through) rows un-permuted with one kv head: row r of HF is GGUF row
        // 2r for r < 8 and 2(r − 8) + 1 after.
        let k = w.get("model.layers.0.self_attn.k_proj.weight").unwrap();
        assert_eq!(k.shape(), vec![16, 32]);
        let k = k.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(k[32], 64.0); // HF row 1 = GGUF row 2
        assert_eq!(k[8 * 32], 32.0); // HF row 8 = GGUF row 1
                                     // v_proj (Q6_K) is re-quantized to affine 8-bit with float32 scales,
                                     // its error recorded.
        let v = report
            .tensors
            .iter()
            .find(|t| t.gguf_name == "blk.0.attn_v.weight")
            .unwrap();
        assert_eq!(v.affine, Some((8, 32)));
        let err = v.requantized.expect("Q6_K is re-quantized");
        let pre = "model.layers.0.self_attn.v_proj";
        assert_eq!(
            w.get(&format!("{pre}.scales")).unwrap().dtype().unwrap(),
            Dtype::Float32
        );
        let dq = mlxcel_core::ops::dequantize(
            &w.get(&format!("{pre}.weight")).unwrap(),
            &w.get(&format!("{pre}.scales")).unwrap(),
            Some(&w.get(&format!("{pre}.biases")).unwrap()),
            mlxcel_core::ops::QuantSpec::affine(32, 8),
            Some(Dtype::Float32),
        )
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
        let exact = blocks::dequantize(GgmlType::Q6K, &v_bytes).unwrap();
        let diff = dq
            .iter()
            .zip(&exact)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff > 0.0 && diff <= err.max_abs_error * 1.0001,
            "{diff} vs {err:?}"
        );

        let tok = tokenizers::Tokenizer::from_file(out.path().join("tokenizer.json")).unwrap();
        assert_eq!(
            tok.encode("ab<|end|>a", false).unwrap().get_ids(),
            &[2, 3, 0]
        );
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(out.path().join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["chat_template"], "{{ messages }}");
        assert_eq!(cfg["eos_token"], "<|end|>");
    }

    #[test]
    fn unsupported_type_and_architecture_are_named() {
        use crate::gguf::reader::tests::{build, string_value, write};
        let arch = |a: &str| vec![("general.architecture", 8u32, string_value(a))];
        let f = write(&build(&arch("mamba"), &[], 32));
        let e = import_gguf(f.path(), Path::new("/nonexistent"), &mut |_, _, _| {}).unwrap_err();
        assert!(e.to_string().contains("`mamba`"), "{e}");

        let mut kvs = arch("llama");
        for k in [
            "block_count",
            "context_length",
            "embedding_length",
            "feed_forward_length",
        ] {
            kvs.push((
                Box::leak(format!("llama.{k}").into_boxed_str()),
                4,
                8u32.to_le_bytes().to_vec(),
            ));
        }
        kvs.push(("llama.attention.head_count", 4, 1u32.to_le_bytes().to_vec()));
        kvs.push((
            "llama.attention.layer_norm_rms_epsilon",
            6,
            1e-6f32.to_le_bytes().to_vec(),
        ));
        let tensors = vec![("blk.0.ffn_up.weight", vec![256, 1], 16, vec![0u8; 66])];
        let f = write(&build(&kvs, &tensors, 32));
        let out = tempfile::tempdir().unwrap();
        let e = import_gguf(f.path(), out.path(), &mut |_, _, _| {}).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("blk.0.ffn_up.weight") && msg.contains("IQ2_XXS"),
            "{msg}"
        );
    }
}

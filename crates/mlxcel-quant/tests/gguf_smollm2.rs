//! The imported SmolLM2-135M-Instruct (from `cargo xtask fetch-models`) against the GGUF it came
//! from, decoded here independently of `mlxcel_quant::gguf`: a minimal GGUF walk and the block
//! formulas of the GGUF spec written out again. Skips (with a line saying so) when the model has
//! not been fetched.

use std::collections::HashMap;
use std::path::PathBuf;

use half::f16;
use mlxcel_core::ops::{dequantize, QuantSpec};
use mlxcel_core::{Dtype, WeightMap};
use serde_json::Value;

fn cache_dir() -> PathBuf {
    mlxcel_core::cache_dir().unwrap_or_default()
}

/// `(model folder, gguf)` or `None` (after printing a skip line) when not fetched.
fn fetched() -> Option<(PathBuf, PathBuf)> {
    let model = cache_dir().join("models/SmolLM2-135M-Instruct-4bit");
    let gguf = cache_dir().join("downloads/SmolLM2-135M-Instruct.Q4_1.gguf");
    if model.join("model.safetensors").is_file() && gguf.is_file() {
        Some((model, gguf))
    } else {
        println!(
            "skip: {} or {} missing (run `cargo xtask fetch-models`)",
            model.display(),
            gguf.display()
        );
        None
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/real/smollm2")
        .join(name)
}

/// Just enough of a GGUF reader for the reference: little-endian reads over the whole file.
struct Walk<'a> {
    b: &'a [u8],
    p: usize,
}

impl<'a> Walk<'a> {
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let s = &self.b[self.p..self.p + n];
        self.p += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes(8).try_into().unwrap())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        String::from_utf8(self.bytes(n).to_vec()).unwrap()
    }
    /// Reads a value of GGUF type `t`, returning it as JSON (arrays of strings/ints included).
    fn value(&mut self, t: u32) -> Value {
        match t {
            0 => Value::from(self.bytes(1)[0]),
            1 => Value::from(self.bytes(1)[0] as i8),
            2 => Value::from(u16::from_le_bytes(self.bytes(2).try_into().unwrap())),
            3 => Value::from(i16::from_le_bytes(self.bytes(2).try_into().unwrap())),
            4 => Value::from(self.u32()),
            5 => Value::from(self.u32() as i32),
            6 => Value::from(f32::from_bits(self.u32()) as f64),
            7 => Value::from(self.bytes(1)[0] != 0),
            8 => Value::from(self.string()),
            9 => {
                let et = self.u32();
                let n = self.u64();
                Value::Array((0..n).map(|_| self.value(et)).collect())
            }
            10 => Value::from(self.u64()),
            11 => Value::from(self.u64() as i64),
            12 => Value::from(f64::from_bits(self.u64())),
            _ => panic!("unknown GGUF value type {t}"),
        }
    }
}

struct RefTensor {
    ne: Vec<usize>,
    ty: u32,
    data: usize,
}

struct RefGguf {
    bytes: Vec<u8>,
    meta: HashMap<String, Value>,
    tensors: HashMap<String, RefTensor>,
}

fn read_gguf(path: &PathBuf) -> RefGguf {
    let bytes = std::fs::read(path).unwrap();
    let mut w = Walk { b: &bytes, p: 0 };
    assert_eq!(w.bytes(4), b"GGUF");
    assert_eq!(w.u32(), 3);
    let n_tensors = w.u64();
    let n_kv = w.u64();
    let mut meta = HashMap::new();
    for _ in 0..n_kv {
        let k = w.string();
        let t = w.u32();
        meta.insert(k, w.value(t));
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name = w.string();
        let nd = w.u32();
        let ne: Vec<usize> = (0..nd).map(|_| w.u64() as usize).collect();
        let ty = w.u32();
        let off = w.u64() as usize;
        infos.push((name, ne, ty, off));
    }
    let align = meta
        .get("general.alignment")
        .and_then(Value::as_u64)
        .unwrap_or(32) as usize;
    let start = w.p.div_ceil(align) * align;
    let tensors = infos
        .into_iter()
        .map(|(name, ne, ty, off)| {
            (
                name,
                RefTensor {
                    ne,
                    ty,
                    data: start + off,
                },
            )
        })
        .collect();
    RefGguf {
        bytes,
        meta,
        tensors,
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The GGUF spec's decode: F32 = 0, Q4_1 = 3 (`d, m, qs[16]`; element j in the low nibble of
/// byte j, element j + 16 in its high nibble; `d·q + m`), Q8_0 = 8 (`d, qs[32] i8`; `d·q`).
fn reference_decode(g: &RefGguf, t: &RefTensor) -> Vec<f32> {
    let n: usize = t.ne.iter().product();
    let b = &g.bytes[t.data..];
    let mut out = vec![0f32; n];
    match t.ty {
        0 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
            }
        }
        3 => {
            for blk in 0..n / 32 {
                let x = &b[20 * blk..20 * blk + 20];
                let (d, m) = (f16_at(x, 0), f16_at(x, 2));
                for j in 0..16 {
                    out[32 * blk + j] = d * (x[4 + j] & 15) as f32 + m;
                    out[32 * blk + j + 16] = d * (x[4 + j] >> 4) as f32 + m;
                }
            }
        }
        8 => {
            for blk in 0..n / 32 {
                let x = &b[34 * blk..34 * blk + 34];
                let d = f16_at(x, 0);
                for j in 0..32 {
                    out[32 * blk + j] = d * (x[2 + j] as i8) as f32;
                }
            }
        }
        ty => panic!("the reference decodes F32, Q4_1 and Q8_0 only, not type {ty}"),
    }
    out
}

/// llama.cpp's convert permutation, applied to HF-order rows: the GGUF row order.
fn llama_cpp_permute(w: &[f32], rows: usize, n_head: usize) -> Vec<f32> {
    let cols = w.len() / rows;
    let half = rows / n_head / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for i in 0..2 {
            for j in 0..half {
                let src = (h * 2 + i) * half + j;
                let dst = (h * half + j) * 2 + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn gguf_to_hf(name: &str) -> String {
    let (stem, suffix) = name.rsplit_once('.').unwrap();
    let module = match stem {
        "token_embd" => "model.embed_tokens".to_string(),
        "output_norm" => "model.norm".to_string(),
        "output" => "lm_head".to_string(),
        s => {
            let mut it = s.splitn(3, '.');
            let (_, layer, part) = (it.next(), it.next().unwrap(), it.next().unwrap());
            let hf = [
                ("attn_q", "self_attn.q_proj"),
                ("attn_k", "self_attn.k_proj"),
                ("attn_v", "self_attn.v_proj"),
                ("attn_output", "self_attn.o_proj"),
                ("ffn_gate", "mlp.gate_proj"),
                ("ffn_up", "mlp.up_proj"),
                ("ffn_down", "mlp.down_proj"),
                ("attn_norm", "input_layernorm"),
                ("ffn_norm", "post_attention_layernorm"),
            ]
            .iter()
            .find(|(g, _)| *g == part)
            .unwrap_or_else(|| panic!("unexpected tensor {name}"))
            .1;
            format!("model.layers.{layer}.{hf}")
        }
    };
    format!("{module}.{suffix}")
}

#[test]
fn imported_weights_match_an_independent_gguf_decode() {
    let Some((model, gguf)) = fetched() else {
        return;
    };
    let g = read_gguf(&gguf);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let q = &config["quantization"];
    assert_eq!(config["quantization_config"], *q);
    let n_head = g.meta["llama.attention.head_count"].as_u64().unwrap() as usize;
    let n_kv = g.meta["llama.attention.head_count_kv"].as_u64().unwrap() as usize;
    assert_eq!(config["num_attention_heads"], n_head);
    assert_eq!(config["num_key_value_heads"], n_kv);
    assert_eq!(
        config["tie_word_embeddings"],
        !g.tensors.contains_key("output.weight")
    );

    let weights = WeightMap::open(&model).unwrap();
    let mut checked = HashMap::new();
    let mut worst = 0f64;
    for (name, t) in &g.tensors {
        let hf = gguf_to_hf(name);
        let module = hf.strip_suffix(".weight").unwrap_or(&hf);
        let rows: usize = t.ne[1..].iter().product();
        let mut reference = reference_decode(&g, t);
        let heads = if name.contains(".attn_q.") {
            Some(n_head)
        } else if name.contains(".attn_k.") {
            Some(n_kv)
        } else {
            None
        };
        let ours = match t.ty {
            0 => weights.get(&hf).unwrap().to_vec::<f32>().unwrap(),
            3 | 8 => {
                let bits = if t.ty == 3 { 4 } else { 8 };
                let spec = q.get(module).unwrap_or(q);
                assert_eq!(spec["bits"], bits, "{hf}: declared bits");
                assert_eq!(spec["group_size"], 32, "{hf}: declared group size");
                let w = weights.get(&hf).unwrap();
                assert_eq!(w.dtype().unwrap(), Dtype::Uint32);
                assert_eq!(w.shape(), vec![rows as i32, (t.ne[0] * bits / 32) as i32]);
                // The planes are stored in f16 (exact: GGUF's d and m are f16). MLX dequantizes
                // in the scales' dtype, and an f16 result rounds `d·q + m`; widening the planes to
                // f32 first (exact) makes MLX compute what GGUF defines, in f32.
                let s = weights.get(&format!("{module}.scales")).unwrap();
                let b = weights.get(&format!("{module}.biases")).unwrap();
                assert_eq!(s.dtype().unwrap(), Dtype::Float16);
                let s = s.astype(Dtype::Float32).unwrap();
                let b = b.astype(Dtype::Float32).unwrap();
                let dq = dequantize(
                    &w,
                    &s,
                    Some(&b),
                    QuantSpec::affine(32, bits as i32),
                    Some(Dtype::Float32),
                )
                .unwrap();
                assert_eq!(dq.shape(), vec![rows as i32, t.ne[0] as i32]);
                dq.to_vec::<f32>().unwrap()
            }
            ty => panic!("{name}: this file should hold F32, Q4_1 and Q8_0 only, found {ty}"),
        };
        let ours = match heads {
            Some(h) => llama_cpp_permute(&ours, rows, h),
            None => ours,
        };
        assert_eq!(ours.len(), reference.len(), "{name}");
        for (i, (a, r)) in ours.iter().zip(reference.iter_mut()).enumerate() {
            let err = (a - *r).abs() as f64;
            let rel = err / (r.abs() as f64).max(1e-30);
            assert!(
                err == 0.0 || rel <= 1e-6,
                "{name} element {i}: imported {a} vs GGUF {r} (relative {rel:e})"
            );
            worst = worst.max(if err == 0.0 { 0.0 } else { rel });
        }
        checked.insert(hf, t.ty);
    }
    assert_eq!(checked.len(), 272);
    assert_eq!(checked.values().filter(|t| **t == 3).count(), 210);
    assert_eq!(checked["model.embed_tokens.weight"], 8);
    println!(
        "{} tensors match the reference decode; worst relative error {worst:e}",
        checked.len()
    );
}

#[test]
fn rebuilt_tokenizer_reproduces_the_reference_ids_and_template() {
    let Some((model, gguf)) = fetched() else {
        return;
    };
    let tok = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).unwrap();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tokenizer_roundtrip.json")).unwrap(),
    )
    .unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let enc = tok.encode(text, false).unwrap();
        assert_eq!(enc.get_ids(), want.as_slice(), "ids of {text:?}");
        let decoded = tok.decode(&want, false).unwrap();
        assert_eq!(
            decoded,
            case["decoded"].as_str().unwrap(),
            "decode of {text:?}"
        );
    }
    // The chat prompt of the golden generation, special tokens included.
    let greedy: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("greedy.json")).unwrap()).unwrap();
    for chat in greedy["chats"].as_array().unwrap() {
        let enc = tok
            .encode(chat["prompt_text"].as_str().unwrap(), false)
            .unwrap();
        let want: Vec<u32> = chat["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(enc.get_ids(), want.as_slice());
    }

    let g = read_gguf(&gguf);
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["chat_template"], g.meta["tokenizer.chat_template"]);
    let tokens = g.meta["tokenizer.ggml.tokens"].as_array().unwrap();
    let bos = g.meta["tokenizer.ggml.bos_token_id"].as_u64().unwrap() as usize;
    let eos = g.meta["tokenizer.ggml.eos_token_id"].as_u64().unwrap() as usize;
    assert_eq!(cfg["bos_token"], tokens[bos]);
    assert_eq!(cfg["eos_token"], tokens[eos]);
    let gen: Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(gen["eos_token_id"], eos);
    assert_eq!(tok.get_vocab_size(true), tokens.len());
}

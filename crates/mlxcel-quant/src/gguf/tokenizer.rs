//! Rebuilding `tokenizer.json` and `tokenizer_config.json` from GGUF tokenizer metadata.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE: `tokens`, `merges`,
//! `token_type`). Control tokens (type 3) become special added tokens, user-defined ones
//! (type 4) plain added tokens. The pre-tokenizer is llama.cpp's for `tokenizer.ggml.pre`
//! (`default`, `gpt2`, `smollm`, `llama-bpe`/`llama3`, `qwen2`; see [`pre_tokenizer_regexes`]),
//! written as a sequence of HF `Split`s; anything else is an error naming the value.

use std::collections::HashSet;

use serde_json::{json, Map, Value};

use super::reader::{GgufFile, MetaValue};
use super::GgufError;

/// The tokenizer files rebuilt from a GGUF, and the ids the model configs need.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerFiles {
    /// The contents of `tokenizer.json` (HF `tokenizers` format).
    pub tokenizer: Value,
    /// The contents of `tokenizer_config.json` (special tokens, chat template when the GGUF
    /// carries one).
    pub tokenizer_config: Value,
    /// `tokenizer.ggml.bos_token_id`, when set.
    pub bos_id: Option<u64>,
    /// `eos_token_id`, then `eot_token_id`/`eom_token_id` when they differ.
    pub eos_ids: Vec<u64>,
    /// `tokenizer.ggml.padding_token_id`, when set.
    pub pad_id: Option<u64>,
}

const TOKEN_NORMAL: i64 = 1;
const TOKEN_UNKNOWN: i64 = 2;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// GPT-2's byte → printable character table: printable Latin-1 bytes stand for themselves,
/// the rest are shifted to U+0100 onwards in byte order.
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            b as char
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or('\0')
        };
    }
    table
}

fn string_array<'a>(g: &'a GgufFile, key: &str) -> Result<Option<Vec<&'a str>>, GgufError> {
    let Some(v) = g.get(key) else {
        return Ok(None);
    };
    let items = v.as_array().ok_or_else(|| {
        GgufError::metadata(
            g.path(),
            key,
            format!("expected an array, found {}", v.type_name()),
        )
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_str().ok_or_else(|| {
                GgufError::metadata(g.path(), key, format!("element {i} is not a string"))
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn id_field(g: &GgufFile, key: &str, n_tokens: usize) -> Result<Option<u64>, GgufError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < n_tokens => Ok(Some(id)),
            _ => Err(GgufError::metadata(
                g.path(),
                key,
                format!("{v:?} is not a token id below {n_tokens}"),
            )),
        },
    }
}

fn flag(g: &GgufFile, key: &str) -> Result<Option<bool>, GgufError> {
    match g.get(key) {
        None => Ok(None),
        Some(MetaValue::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(GgufError::metadata(
            g.path(),
            key,
            format!("expected a bool, found {}", v.type_name()),
        )),
    }
}

/// GPT-2's split (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_GPT2`).
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// The `tokenizer.ggml.pre` values [`pre_tokenizer_regexes`] knows.
const KNOWN_PRE_TOKENIZERS: [&str; 9] = [
    "gpt-2",
    "default",
    "gpt2",
    "smollm",
    "llama-bpe",
    "llama3",
    "llama-v3",
    "qwen2",
    "deepseek-r1-qwen",
];

/// llama.cpp's pre-tokenizer for `tokenizer.ggml.pre` (`llm_tokenizer_bpe` in llama-vocab.cpp):
/// its regexes in order, and whether a piece that is itself a token skips the merges
/// (`ignore_merges`). Llama 3 and Qwen 2 use their `tokenizer.json` regexes (llama.cpp spells
/// the case-insensitive contractions out by hand; the `tokenizers` regex engine reads `(?i:)`).
fn pre_tokenizer_regexes(pre: &str) -> Option<(Vec<&'static str>, bool)> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        // The regexes llama.cpp falls back to for GGUFs older than `tokenizer.ggml.pre`.
        "default" => (
            vec![
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_SPLIT,
                r"\p{N}+",
                "[0-9][0-9][0-9]",
            ],
            false,
        ),
        "gpt-2" | "gpt2" => (vec![GPT2_SPLIT], false),
        "smollm" => (vec![r"\p{N}", GPT2_SPLIT], false),
        "llama-bpe" | "llama3" | "llama-v3" => (vec![LLAMA3], true),
        "qwen2" | "deepseek-r1-qwen" => (vec![QWEN2], false),
        _ => return None,
    })
}

fn byte_level(add_prefix_space: bool, trim_offsets: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space,
           "trim_offsets": trim_offsets, "use_regex": true})
}

/// The model-specific pieces of `tokenizer.json`.
struct Parts {
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// The post-processor when no BOS/EOS is added.
    post_processor: Value,
    model: Value,
    /// Whether a control token is matched literally in text (an added special token).
    literal: fn(&str) -> bool,
}

fn in_byte_alphabet(tok: &str) -> bool {
    let alphabet = byte_alphabet();
    tok.chars().all(|c| alphabet.contains(&c))
}

/// Byte-level BPE (`gpt2`): the GGUF's merges, llama.cpp's pre-tokenizer regexes.
fn byte_level_bpe(g: &GgufFile, tokens: &[&str]) -> Result<Parts, GgufError> {
    let path = g.path();
    let merges_key = "tokenizer.ggml.merges";
    let merges = string_array(g, merges_key)?
        .ok_or_else(|| GgufError::metadata(path, merges_key, "missing"))?;
    let pre_key = "tokenizer.ggml.pre";
    let pre = g.get(pre_key).and_then(|v| v.as_str()).unwrap_or("default");
    let add_space = flag(g, "tokenizer.ggml.add_space_prefix")?.unwrap_or(false);
    let (regexes, ignore_merges) = pre_tokenizer_regexes(pre).ok_or_else(|| {
        GgufError::metadata(
            path,
            pre_key,
            format!(
                "pre-tokenizer `{pre}` is not known (supported: {})",
                KNOWN_PRE_TOKENIZERS.join(", ")
            ),
        )
    })?;
    // llama.cpp applies its regexes one after the other, each splitting the pieces the previous
    // left and keeping the text between matches as pieces too: HF's `Split` with `Isolated`.
    let mut pretokenizers: Vec<Value> = regexes
        .iter()
        .map(|r| {
            json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
                   "invert": false})
        })
        .collect();
    pretokenizers.push(json!({"type": "ByteLevel", "add_prefix_space": add_space,
                              "trim_offsets": true, "use_regex": false}));
    let pre_tokenizer = json!({"type": "Sequence", "pretokenizers": pretokenizers});

    // Tokens are stored in the byte alphabet already; one that is not (a raw-text control token
    // written by some converters) is spelled through it so the BPE vocabulary stays consistent.
    let alphabet = byte_alphabet();
    let in_alphabet: HashSet<char> = alphabet.iter().copied().collect();
    let mut vocab = Map::new();
    for (id, tok) in tokens.iter().enumerate() {
        let key = if tok.chars().all(|c| in_alphabet.contains(&c)) {
            tok.to_string()
        } else {
            tok.bytes().map(|b| alphabet[b as usize]).collect()
        };
        vocab.insert(key, json!(id));
    }
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| {
                    GgufError::metadata(path, merges_key, format!("merge {i} `{m}` has no space"))
                })
        })
        .collect::<Result<Vec<_>, _>>()?;

    Ok(Parts {
        normalizer: Value::Null,
        pre_tokenizer,
        decoder: byte_level(true, true),
        post_processor: byte_level(true, false),
        model: json!({
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": ignore_merges, "vocab": vocab,
            "merges": merges,
        }),
        literal: in_byte_alphabet,
    })
}

/// SentencePiece (`llama`), as llama.cpp's `llm_tokenizer_spm` runs it: spaces are `▁`, a `▁`
/// is prepended to every run of text when `add_space_prefix` (default on; llama.cpp also
/// prepends after each special token, which HF's per-segment `Prepend` normaliser does too),
/// adjacent pieces merge highest score first, and characters outside the vocabulary fall back
/// to `<0xXX>` byte tokens. As a BPE: every split of a normal token into two vocabulary pieces
/// is a merge, ranked by the token's score (then by the pieces' ids, as transformers'
/// SentencePiece extractor orders them).
fn sentencepiece(g: &GgufFile, tokens: &[&str], types: &[i64]) -> Result<Parts, GgufError> {
    let path = g.path();
    let scores_key = "tokenizer.ggml.scores";
    let scores: Vec<f64> = g
        .get(scores_key)
        .and_then(|v| v.as_array())
        .filter(|a| a.len() == tokens.len())
        .and_then(|a| a.iter().map(|s| s.as_f64()).collect::<Option<Vec<_>>>())
        .ok_or_else(|| {
            GgufError::metadata(
                path,
                scores_key,
                format!("expected {} floats, one per token", tokens.len()),
            )
        })?;
    let mut vocab = Map::new();
    let mut ids = std::collections::HashMap::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.to_string(), json!(id));
        ids.entry(*tok).or_insert(id);
    }
    let mut merges: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        if types[id] != TOKEN_NORMAL {
            continue;
        }
        for (at, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                merges.push((scores[id], id, li, ri));
            }
        }
    }
    // Score descending; a stable order after that: the token's id, then the pieces' ids.
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then((a.2, a.3).cmp(&(b.2, b.3)))
    });
    let merges: Vec<Value> = merges
        .iter()
        .map(|(_, _, l, r)| json!([tokens[*l], tokens[*r]]))
        .collect();
    let unk = id_field(g, "tokenizer.ggml.unknown_token_id", tokens.len())?
        .map(|i| tokens[i as usize].to_string());
    let add_space = flag(g, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let replace_space =
        json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if add_space {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"}, replace_space]})
    } else {
        replace_space
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok(Parts {
        normalizer,
        pre_tokenizer: Value::Null,
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        post_processor: Value::Null,
        model: json!({
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges,
        }),
        literal: |_| true,
    })
}

/// Builds `tokenizer.json` and `tokenizer_config.json` for a byte-level BPE (`gpt2`) or
/// SentencePiece (`llama`) GGUF.
pub fn build_tokenizer_files(g: &GgufFile, n_ctx: u64) -> Result<TokenizerFiles, GgufError> {
    let path = g.path();
    let model_key = "tokenizer.ggml.model";
    let model = g
        .get(model_key)
        .and_then(|v| v.as_str())
        .ok_or_else(|| GgufError::metadata(path, model_key, "missing or not a string"))?;
    if model != "gpt2" && model != "llama" {
        return Err(GgufError::metadata(
            path,
            model_key,
            format!(
                "tokenizer model `{model}` cannot be rebuilt yet (only byte-level BPE `gpt2` and \
                 SentencePiece `llama`)"
            ),
        ));
    }
    let tokens_key = "tokenizer.ggml.tokens";
    let tokens = string_array(g, tokens_key)?
        .ok_or_else(|| GgufError::metadata(path, tokens_key, "missing"))?;
    let types_key = "tokenizer.ggml.token_type";
    let token_types: Vec<i64> = match g.get(types_key) {
        None => vec![1; tokens.len()],
        Some(v) => v
            .as_array()
            .filter(|a| a.len() == tokens.len())
            .and_then(|a| a.iter().map(|t| t.as_i64()).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                GgufError::metadata(
                    path,
                    types_key,
                    format!("expected {} integers, one per token", tokens.len()),
                )
            })?,
    };

    let parts = if model == "gpt2" {
        byte_level_bpe(g, &tokens)?
    } else {
        sentencepiece(g, &tokens, &token_types)?
    };

    let mut added = Vec::new();
    let mut added_decoder = Map::new();
    for (id, (tok, ty)) in tokens.iter().zip(&token_types).enumerate() {
        let special = match *ty {
            TOKEN_CONTROL | TOKEN_UNKNOWN if (parts.literal)(tok) => true,
            TOKEN_USER_DEFINED => false,
            _ => continue,
        };
        let entry = json!({"content": tok, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": special});
        let mut with_id = Map::new();
        with_id.insert("id".into(), json!(id));
        if let Value::Object(fields) = &entry {
            with_id.extend(fields.clone());
        }
        added.push(Value::Object(with_id));
        added_decoder.insert(id.to_string(), entry);
    }

    let n = tokens.len();
    let bos_id = id_field(g, "tokenizer.ggml.bos_token_id", n)?;
    let eos_id = id_field(g, "tokenizer.ggml.eos_token_id", n)?;
    let unk_id = id_field(g, "tokenizer.ggml.unknown_token_id", n)?;
    let pad_id = id_field(g, "tokenizer.ggml.padding_token_id", n)?;
    let mut eos_ids: Vec<u64> = eos_id.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = id_field(g, key, n)? {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
    }
    let add_bos = flag(g, "tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let add_eos = flag(g, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let token = |id: Option<u64>| id.map(|i| tokens[i as usize].to_string());

    let post_processor = if add_bos || add_eos {
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let mut specials = Map::new();
        let mut special = |id: Option<u64>, key: &str| -> Result<Value, GgufError> {
            let id = id.ok_or_else(|| {
                GgufError::metadata(path, key, "is required by add_bos/add_eos_token")
            })?;
            let tok = tokens[id as usize];
            specials.insert(tok.into(), json!({"id": tok, "ids": [id], "tokens": [tok]}));
            Ok(json!({"SpecialToken": {"id": tok, "type_id": 0}}))
        };
        let bos = if add_bos {
            Some(special(bos_id, "tokenizer.ggml.bos_token_id")?)
        } else {
            None
        };
        let eos = if add_eos {
            Some(special(eos_id, "tokenizer.ggml.eos_token_id")?)
        } else {
            None
        };
        for (seq, type_id) in [("A", 0), ("B", 1)] {
            let target = if seq == "A" { &mut single } else { &mut pair };
            let part = json!({"Sequence": {"id": seq, "type_id": type_id}});
            for t in [&bos, &Some(part), &eos].into_iter().flatten() {
                target.push(t.clone());
            }
        }
        let pair: Vec<Value> = single.iter().cloned().chain(pair).collect();
        json!({"type": "TemplateProcessing", "single": single, "pair": pair,
               "special_tokens": specials})
    } else {
        parts.post_processor.clone()
    };

    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": parts.normalizer,
        "pre_tokenizer": parts.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": parts.decoder,
        "model": parts.model,
    });

    let mut cfg = Map::new();
    cfg.insert("add_bos_token".into(), json!(add_bos));
    cfg.insert("add_eos_token".into(), json!(add_eos));
    cfg.insert("added_tokens_decoder".into(), Value::Object(added_decoder));
    cfg.insert("bos_token".into(), json!(token(bos_id)));
    cfg.insert("eos_token".into(), json!(token(eos_id)));
    cfg.insert("pad_token".into(), json!(token(pad_id)));
    cfg.insert("unk_token".into(), json!(token(unk_id)));
    cfg.insert("clean_up_tokenization_spaces".into(), json!(false));
    cfg.insert("model_max_length".into(), json!(n_ctx));
    cfg.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    let template_key = "tokenizer.chat_template";
    match g.get(template_key) {
        None => {}
        Some(MetaValue::String(t)) => {
            cfg.insert("chat_template".into(), json!(t));
        }
        Some(v) => {
            return Err(GgufError::metadata(
                path,
                template_key,
                format!("expected a string, found {}", v.type_name()),
            ))
        }
    }

    Ok(TokenizerFiles {
        tokenizer,
        tokenizer_config: Value::Object(cfg),
        bos_id,
        eos_ids,
        pad_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_matches_gpt2() {
        let a = byte_alphabet();
        assert_eq!(a[b' ' as usize], 'Ġ'); // U+0120: the 33rd shifted byte
        assert_eq!(a[b'\n' as usize], 'Ċ'); // U+010A
        assert_eq!(a[0], 'Ā'); // U+0100
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[0xAD], 'Ń'); // soft hyphen is shifted (U+0143)
        assert_eq!(a.iter().collect::<HashSet<_>>().len(), 256);
    }
}

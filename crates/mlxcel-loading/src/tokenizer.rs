//! Tokenizer loading: `tokenizer.json` through the `tokenizers` crate. SentencePiece
//! (`tokenizer.model`) and tiktoken files without a `tokenizer.json` are refused with the reason.

use std::path::{Path, PathBuf};

use crate::{LoadError, Result};

/// A model's tokenizer (its `tokenizer.json`), from [`load_tokenizer`].
///
/// Special tokens: [`Tokenizer::encode`] with `add_special_tokens = true` adds what the
/// tokenizer's post-processor adds (a BOS token, for many models). A prompt rendered by a chat
/// template ([`crate::ChatTemplate::render`]) already contains every special token the model
/// expects, so it must be encoded WITHOUT adding special tokens, `encode(&text, false)`;
/// encoding it with `true` would add a second BOS. Plain text prompts (no template) are usually
/// encoded with `true`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The `tokenizer.json` it was read from (named in errors).
    pub path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Token ids of `text`, with the tokenizer's special-token post-processing when
    /// `add_special_tokens`. Pass `false` for text rendered by a chat template (it already
    /// holds the special tokens; see [`Tokenizer`]). An error names `tokenizer.json`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| LoadError::file(&self.path, format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, leaving out special tokens (BOS, EOS, turn markers) when
    /// `skip_special_tokens`. For text streamed token by token use [`StreamDecoder`].
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| LoadError::file(&self.path, format!("decoding failed: {e}")))
    }

    /// Sets what encoders need: no padding (batches are padded by the caller), and truncation
    /// to `max_tokens` (special tokens included) when given, else none. Replaces whatever
    /// `tokenizer.json` asks for (all-MiniLM-L6-v2's pads every text to 128).
    pub fn set_encoder_limits(&mut self, max_tokens: Option<usize>) -> Result<()> {
        self.inner.with_padding(None);
        let truncation = max_tokens.map(|max_length| tokenizers::TruncationParams {
            max_length,
            ..Default::default()
        });
        self.inner
            .with_truncation(truncation)
            .map_err(|e| LoadError::file(&self.path, format!("cannot set truncation: {e}")))?;
        Ok(())
    }

    /// Like [`Tokenizer::encode`], also telling whether the tokenizer's truncation dropped
    /// tokens (see [`Tokenizer::set_encoder_limits`]).
    pub fn encode_checked(&self, text: &str, add_special_tokens: bool) -> Result<(Vec<u32>, bool)> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| LoadError::file(&self.path, format!("encoding failed: {e}")))?;
        Ok((enc.get_ids().to_vec(), !enc.get_overflowing().is_empty()))
    }

    /// A pair (`first`, `second`: a query and a document) through the tokenizer's pair template
    /// (e.g. `[CLS] first [SEP] second [SEP]`), special tokens added: the ids, the token-type
    /// ids the template assigns (0 for the first part, 1 for the second, where it has types), and
    /// whether truncation (longest part first, see [`Tokenizer::set_encoder_limits`]) dropped
    /// tokens.
    pub fn encode_pair_checked(
        &self,
        first: &str,
        second: &str,
    ) -> Result<(Vec<u32>, Vec<u32>, bool)> {
        let enc = self
            .inner
            .encode((first, second), true)
            .map_err(|e| LoadError::file(&self.path, format!("encoding a pair failed: {e}")))?;
        Ok((
            enc.get_ids().to_vec(),
            enc.get_type_ids().to_vec(),
            !enc.get_overflowing().is_empty(),
        ))
    }

    /// The id of `token` (e.g. `"<|im_end|>"`), `None` when not in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of `id` (e.g. `"<start_of_image>"`), `None` when not in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// What each token id contributes to decoded text, as raw bytes, for code that works on
    /// token strings (constrained decoding, logprob listings): index `id` holds
    /// [`TokenBytes`] for that id, ids the vocabulary lacks are empty and special.
    ///
    /// Byte-level BPE tokens (GPT-2, Llama 3, Qwen, SmolLM) map back through the byte-to-unicode
    /// table, so a token that holds half of a UTF-8 character gives exactly those bytes.
    /// SentencePiece-style vocabularies map `▁` to a space and `<0xNN>` byte-fallback tokens to
    /// their byte. Added tokens give their text; special ones are marked.
    pub fn token_bytes(&self) -> Vec<TokenBytes> {
        let size = self.vocab_size();
        let byte_level = self.inner.get_decoder().is_some_and(is_byte_level);
        let specials: std::collections::HashSet<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        let added: std::collections::HashSet<u32> =
            self.inner.get_added_tokens_decoder().into_keys().collect();
        let unicode_to_byte: std::collections::HashMap<char, u8> =
            byte_to_unicode().iter().map(|(b, c)| (*c, *b)).collect();
        (0..size as u32)
            .map(|id| {
                let Some(token) = self.inner.id_to_token(id) else {
                    return TokenBytes {
                        bytes: Vec::new(),
                        special: true,
                    };
                };
                let special = specials.contains(&id);
                let bytes = if added.contains(&id) {
                    token.into_bytes()
                } else if byte_level {
                    // Every character of a byte-level token is one byte in disguise; one that
                    // is not in the table (a hand-edited vocabulary) stays as its UTF-8.
                    let mut out = Vec::with_capacity(token.len());
                    for c in token.chars() {
                        match unicode_to_byte.get(&c) {
                            Some(b) => out.push(*b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                } else if let Some(byte) = byte_fallback(&token) {
                    vec![byte]
                } else {
                    token.replace('\u{2581}', " ").into_bytes()
                };
                TokenBytes { bytes, special }
            })
            .collect()
    }
}

/// The bytes of one token (see [`Tokenizer::token_bytes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBytes {
    /// What the token adds to decoded text (a special token: its own text, e.g. `<|im_end|>`).
    pub bytes: Vec<u8>,
    /// A special (control) token: skipped when decoding, never part of plain output.
    pub special: bool,
}

fn is_byte_level(decoder: &tokenizers::decoders::DecoderWrapper) -> bool {
    match decoder {
        tokenizers::decoders::DecoderWrapper::ByteLevel(_) => true,
        tokenizers::decoders::DecoderWrapper::Sequence(s) => {
            s.get_decoders().iter().any(is_byte_level)
        }
        _ => false,
    }
}

/// `<0x0A>` → 0x0A (SentencePiece byte fallback).
fn byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
}

/// GPT-2's reversible map from bytes to printable characters, which byte-level BPE
/// vocabularies are written in.
fn byte_to_unicode() -> Vec<(u8, char)> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b, char::from(b))
            } else {
                let c = char::from_u32(next).unwrap_or('\u{FFFD}');
                next += 1;
                (b, c)
            }
        })
        .collect()
}

/// Reads `folder`'s `tokenizer.json`. A folder with only a SentencePiece `tokenizer.model` or a
/// `*.tiktoken` file, or none at all, is a [`LoadError::File`] saying what to provide.
pub fn load_tokenizer(folder: &Path) -> Result<Tokenizer> {
    let path = folder.join("tokenizer.json");
    if path.exists() {
        let real = mlxcel_core::weights::confined_path(folder, "tokenizer.json")?;
        let inner = tokenizers::Tokenizer::from_file(&real)
            .map_err(|e| LoadError::file(&path, format!("invalid tokenizer: {e}")))?;
        return Ok(Tokenizer { inner, path });
    }
    if folder.join("tokenizer.model").is_file() {
        return Err(LoadError::file(
            folder.join("tokenizer.model"),
            "SentencePiece tokenizers are supported through tokenizer.json only; convert with `transformers` (AutoTokenizer(...).save_pretrained) to write one",
        ));
    }
    let tiktoken = std::fs::read_dir(folder).ok().and_then(|d| {
        d.filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "tiktoken"))
    });
    if let Some(t) = tiktoken {
        return Err(LoadError::file(
            t,
            "tiktoken files are not supported; a tokenizer.json is needed",
        ));
    }
    Err(LoadError::file(
        folder,
        "no tokenizer.json in the model folder",
    ))
}

/// Incremental detokenisation for streaming: text is released only once it no longer ends in
/// a partial UTF-8 sequence (byte-level BPE splits Korean and emoji characters across tokens),
/// and a token's text is computed in the context of the one before it (leading-space rules).
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    progress: DecodeProgress,
}

impl<'t> StreamDecoder<'t> {
    /// A decoder over `tokenizer`, leaving out special tokens when `skip_special_tokens`.
    pub fn new(tokenizer: &'t Tokenizer, skip_special_tokens: bool) -> StreamDecoder<'t> {
        StreamDecoder {
            tokenizer,
            progress: DecodeProgress::new(skip_special_tokens),
        }
    }

    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.progress.push(self.tokenizer, id)
    }

    /// Text still held back (an incomplete character at the very end, rendered as decoded).
    pub fn flush(&mut self) -> Result<String> {
        self.progress.flush(self.tokenizer)
    }
}

/// A [`StreamDecoder`]'s progress without the tokenizer, which each call passes instead: what
/// an owner of many streams over one shared tokenizer keeps per stream.
#[derive(Debug, Clone)]
pub struct DecodeProgress {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl DecodeProgress {
    /// Nothing decoded yet; special tokens left out when `skip_special_tokens`.
    pub fn new(skip_special_tokens: bool) -> DecodeProgress {
        DecodeProgress {
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special_tokens,
        }
    }

    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let skip = self.skip_special_tokens;
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], skip)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let text = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(text);
        }
        Ok(String::new())
    }

    /// Text still held back (an incomplete character at the very end, rendered as decoded).
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let skip = self.skip_special_tokens;
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], skip)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.strip_prefix(prefix.as_str()).unwrap_or("").to_string())
    }
}

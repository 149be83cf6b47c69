//! The reranker kind: cross-encoders ([`RerankerModel`]: one query/document pair per row, as
//! token ids, token types and an attention mask, in; relevance logits out). A cross-encoder is an
//! encoder with a classification head (`*ForSequenceClassification`); it never implements
//! [`crate::LanguageModel`] or [`crate::EmbeddingModel`].

use mlxcel_core::Array;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::Result;

/// A cross-encoder: pairs encoded together (`[CLS] query [SEP] document [SEP]`), scored by a
/// classification head.
pub trait RerankerModel {
    /// `ids`, `type_ids` and `mask` `[B, L]` (int32; `mask` 1 = real token) → logits
    /// `[B, num_labels]` (no activation). `type_ids` are ignored by models without token types.
    fn logits(&self, ids: &Array, type_ids: &Array, mask: &Array) -> Result<Array>;

    /// Width of one row of logits (the classifier's outputs).
    fn num_labels(&self) -> usize;

    /// Whether the model adds token-type embeddings (BERT with `type_vocab_size` > 1): then the
    /// tokenizer's pair template supplies the ids (0 for the query, 1 for the document).
    fn uses_token_types(&self) -> bool;

    /// Rows of the token embedding table (token ids must be below it).
    fn vocab_size(&self) -> usize;

    /// The most tokens one pair may have (the position table's reach), when bounded.
    fn max_tokens(&self) -> Option<usize>;
}

/// The label keys of a classification `config.json`: transformers' `num_labels` is the length of
/// `id2label` when present, else `num_labels`, else 2.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Labels {
    /// `id2label`: one entry per classifier output.
    #[serde(default)]
    pub id2label: Option<Map<String, Value>>,
    /// `num_labels` (configs that do not write `id2label`).
    #[serde(default)]
    pub num_labels: Option<usize>,
}

impl Labels {
    /// The number of classifier outputs the config implies.
    pub fn count(&self) -> usize {
        match (&self.id2label, self.num_labels) {
            (Some(m), _) => m.len(),
            (None, Some(n)) => n,
            (None, None) => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_count_follows_transformers() {
        let parse = |s: &str| serde_json::from_str::<Labels>(s).unwrap().count();
        assert_eq!(parse(r#"{"id2label": {"0": "LABEL_0"}}"#), 1);
        assert_eq!(
            parse(r#"{"id2label": {"0": "a", "1": "b"}, "num_labels": 1}"#),
            2
        );
        assert_eq!(parse(r#"{"num_labels": 3}"#), 3);
        assert_eq!(parse("{}"), 2);
    }
}

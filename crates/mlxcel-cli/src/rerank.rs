//! `mlxcel rerank`: a query and documents in, one relevance score per document out (JSON lines,
//! in input order or sorted by score).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use mlxcel_loading::{
    load_generative_reranker, load_reranker_model, LoadOptions, Overflow, RerankOptions,
};

#[derive(Args)]
pub struct RerankFlags {
    /// The cross-encoder folder (BERT, XLM-RoBERTa, ModernBERT `*ForSequenceClassification`), or
    /// with --generative a generator scored the Qwen3-Reranker way.
    #[arg(long)]
    model: PathBuf,
    /// The model is a generative reranker (Qwen3-Reranker: yes/no logits in its prompt).
    #[arg(long)]
    generative: bool,
    /// The `<Instruct>` line of a generative reranker's prompt (default: the model card's).
    #[arg(long, requires = "generative")]
    instruction: Option<String>,
    /// The query every document is scored against.
    #[arg(long)]
    query: String,
    /// A document to score (repeatable).
    #[arg(long)]
    document: Vec<String>,
    /// A file with one document per line (empty lines skipped).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Print the documents best first instead of in input order.
    #[arg(long)]
    sorted: bool,
    /// Refuse pairs longer than the model's limit instead of truncating them with a warning.
    #[arg(long)]
    refuse_overlong: bool,
    /// Pairs per forward pass.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

pub fn run(flags: RerankFlags) -> anyhow::Result<()> {
    let mut documents = flags.document.clone();
    if let Some(path) = &flags.file {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        documents.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string),
        );
    }
    if documents.is_empty() {
        bail!("no documents: give --document or --file");
    }
    let options = LoadOptions {
        policy: Some(mlxcel_core::policy::current()),
        ..Default::default()
    };
    let model = if flags.generative {
        load_generative_reranker(&flags.model, &options)?
    } else {
        load_reranker_model(&flags.model, &options)?
    };
    let rerank = RerankOptions {
        overflow: if flags.refuse_overlong {
            Overflow::Refuse
        } else {
            Overflow::TruncateWithWarning
        },
        batch_size: flags.batch_size.max(1),
        instruction: flags.instruction.clone(),
    };
    let refs: Vec<&str> = documents.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let scores = model.score(&flags.query, &refs, &rerank)?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    if flags.sorted {
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for i in order {
        let line = serde_json::json!({"index": i, "score": scores[i], "document": documents[i]});
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    eprintln!(
        "[{}: {} documents in {:.2}s, load {:.2}s, activation {:?} ({})]",
        model.model_type.name(),
        scores.len(),
        started.elapsed().as_secs_f64(),
        model.load_seconds,
        model.activation,
        model.activation_source
    );
    Ok(())
}

//! `mlxcel embed`: texts in, one embedding per text out (JSON lines or NumPy .npy).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use mlxcel_loading::{load_embedding_model, EmbedOptions, LoadOptions, Overflow};

#[derive(Clone, Copy, ValueEnum)]
pub enum Format {
    /// One JSON object per line: `{"index": i, "embedding": [..]}`.
    Jsonl,
    /// One float32 array `[texts, dimensions]` (needs --out).
    Npy,
}

#[derive(Args)]
pub struct EmbedFlags {
    /// The embedding model folder (BERT, XLM-RoBERTa, ModernBERT; sentence-transformers layout).
    #[arg(long)]
    model: PathBuf,
    /// A text to embed (repeatable).
    #[arg(long)]
    text: Vec<String>,
    /// A file with one text per line (empty lines skipped).
    #[arg(long)]
    file: Option<PathBuf>,
    /// `-`: read one text per line from stdin.
    #[arg(value_name = "-")]
    stdin: Option<String>,
    /// Matryoshka truncation to the first N values (re-normalised).
    #[arg(long)]
    dimensions: Option<usize>,
    /// A prompt of config_sentence_transformers.json by name (e.g. `query`).
    #[arg(long)]
    prompt_name: Option<String>,
    /// Refuse texts longer than the model's limit instead of truncating them with a warning.
    #[arg(long)]
    refuse_overlong: bool,
    /// Texts per forward pass.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    #[arg(long, value_enum, default_value = "jsonl")]
    format: Format,
    /// Output file (stdout for jsonl when absent).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also print one JSON line of measurements on stderr (texts, tokens, embed_s, load_s;
    /// what `cargo xtask bench --embeddings` reads).
    #[arg(long)]
    stats_json: bool,
}

fn lines(reader: impl BufRead, what: &str) -> anyhow::Result<Vec<String>> {
    let mut texts = Vec::new();
    for line in reader.lines() {
        let line = line.with_context(|| format!("reading {what}"))?;
        if !line.trim().is_empty() {
            texts.push(line);
        }
    }
    Ok(texts)
}

pub fn run(flags: EmbedFlags) -> anyhow::Result<()> {
    let mut texts = flags.text.clone();
    if let Some(path) = &flags.file {
        let file = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
        texts.extend(lines(
            std::io::BufReader::new(file),
            &path.display().to_string(),
        )?);
    }
    match flags.stdin.as_deref() {
        None => {}
        Some("-") => texts.extend(lines(std::io::stdin().lock(), "stdin")?),
        Some(other) => bail!("unexpected argument `{other}` (use --text, --file or `-`)"),
    }
    if texts.is_empty() {
        bail!("no texts: give --text, --file or `-` (stdin)");
    }
    let options = LoadOptions {
        policy: Some(mlxcel_core::policy::current()),
        ..Default::default()
    };
    let model = load_embedding_model(&flags.model, &options)?;
    let embed = EmbedOptions {
        dimensions: flags.dimensions,
        overflow: if flags.refuse_overlong {
            Overflow::Refuse
        } else {
            Overflow::TruncateWithWarning
        },
        batch_size: flags.batch_size.max(1),
        prompt_name: flags.prompt_name.clone(),
    };
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let vectors = model.embed(&refs, &embed)?;
    let embed_s = started.elapsed().as_secs_f64();
    let width = vectors.first().map_or(0, Vec::len);
    match flags.format {
        Format::Npy => {
            let Some(out) = &flags.out else {
                bail!("--format npy needs --out FILE");
            };
            let flat: Vec<f32> = vectors.iter().flatten().copied().collect();
            crate::npy::write_f32(out, &[vectors.len(), width], &flat)
                .with_context(|| format!("writing {}", out.display()))?;
        }
        Format::Jsonl => {
            let mut sink: Box<dyn Write> = match &flags.out {
                Some(p) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(p).with_context(|| format!("{}", p.display()))?,
                )),
                None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
            };
            for (i, v) in vectors.iter().enumerate() {
                let line = serde_json::json!({"index": i, "embedding": v});
                writeln!(sink, "{line}")?;
            }
            sink.flush()?;
        }
    }
    eprintln!(
        "[{}: {} texts x {} dims in {:.2}s, load {:.2}s]",
        model.model_type.name(),
        vectors.len(),
        width,
        embed_s,
        model.load_seconds
    );
    if flags.stats_json {
        let mut tokens = 0;
        for t in &refs {
            tokens += model.tokenize(t, &embed)?.0.len();
        }
        let line = serde_json::json!({
            "texts": vectors.len(),
            "tokens": tokens,
            "embed_s": embed_s,
            "load_s": model.load_seconds,
        });
        eprintln!("{line}");
    }
    Ok(())
}

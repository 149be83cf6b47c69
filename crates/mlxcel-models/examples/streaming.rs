//! Streams a reply piece by piece, and cancels a second one after a few pieces.
//!
//! `cargo run --release -p mlxcel-models --example streaming [MODEL_DIR]`

mod common;

use std::io::Write;

use mlxcel_models::{FinishReason, Generation, Message, Model};

fn main() -> Result<(), mlxcel_models::Error> {
    let model = Model::load(common::model_dir()).build()?;
    let question = vec![Message::user("What is the capital of France?")];
    let mut stream = model.generate(question, Generation::default())?;
    for piece in stream.by_ref() {
        print!("{}", piece?.text);
        let _ = std::io::stdout().flush();
    }
    println!();
    let stats = stream.stats().cloned();
    if let Some(s) = stats {
        eprintln!("[{:.1} tokens/s]", s.decode_tokens_per_second());
    }
    // Cancelled after three pieces: the stream ends, the statistics say why.
    let mut long = model.generate(
        vec![Message::user("Write a long story about a lighthouse.")],
        Generation::default(),
    )?;
    let mut pieces = 0;
    while let Some(piece) = long.next() {
        piece?;
        pieces += 1;
        if pieces == 3 {
            long.cancel();
        }
    }
    let finish = long.stats().map(|s| s.finish);
    println!("cancelled after {pieces} pieces: {finish:?}");
    assert_eq!(finish, Some(FinishReason::Cancelled));
    Ok(())
}

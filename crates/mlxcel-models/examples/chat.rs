//! A two-turn chat: the second turn reuses the first turn's caches.
//!
//! `cargo run --release -p mlxcel-models --example chat [MODEL_DIR]`

mod common;

use mlxcel_models::{Generation, Message, Model};

fn main() -> Result<(), mlxcel_models::Error> {
    let model = Model::load(common::model_dir()).build()?;
    let mut chat = model.session();
    let mut messages = vec![Message::user("What is the capital of France?")];
    for follow_up in ["And of Germany?", ""] {
        let (reply, stats) = chat
            .generate(messages.clone(), Generation::default())?
            .finish()?;
        println!("assistant: {reply}");
        eprintln!(
            "[{} prompt tokens, {} reused from the previous turn, {} generated]",
            stats.prompt_tokens, stats.reused_tokens, stats.generated_tokens
        );
        if follow_up.is_empty() {
            break;
        }
        messages.push(Message::assistant(&reply));
        messages.push(Message::user(follow_up));
    }
    Ok(())
}

//! Token ids in, next-token logits out: the five most likely next tokens after a prompt.
//!
//! `cargo run --release -p mlxcel-models --example logits [MODEL_DIR]`

mod common;

use mlxcel_models::{Model, Prompt};

fn main() -> Result<(), mlxcel_models::Error> {
    let model = Model::load(common::model_dir()).build()?;
    let ids = model.prompt_ids(&Prompt::Text("The capital of France is".into()))?;
    let logits = model.logits(&ids)?;
    assert_eq!(logits.len(), model.info().vocab_size);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    for &id in &order[..5] {
        println!("{:>8.3}  {:?}", logits[id], model.decode(&[id as u32])?);
    }
    Ok(())
}

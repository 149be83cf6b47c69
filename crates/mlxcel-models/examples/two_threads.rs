//! One model, two threads: the handle is `Send + Sync`, so clones move into threads; their
//! requests are served one after the other by the model's worker.
//!
//! `cargo run --release -p mlxcel-models --example two_threads [MODEL_DIR]`

mod common;

use mlxcel_models::{Generation, Message, Model};

fn main() -> Result<(), mlxcel_models::Error> {
    let model = Model::load(common::model_dir()).build()?;
    let questions = [
        "What is the capital of France?",
        "What is the capital of Italy?",
    ];
    let threads: Vec<_> = questions
        .into_iter()
        .map(|q| {
            let model = model.clone();
            std::thread::spawn(move || -> Result<String, mlxcel_models::Error> {
                let (reply, _) = model
                    .generate(vec![Message::user(q)], Generation::default())?
                    .finish()?;
                Ok(format!("{q} -> {reply}"))
            })
        })
        .collect();
    for t in threads {
        match t.join() {
            Ok(answer) => println!("{}", answer?),
            Err(_) => eprintln!("a thread panicked"),
        }
    }
    Ok(())
}

//! Loads SmolLM2, streams an answer, reads logits, chats for two turns reusing the first turn's
//! caches, and answers from another thread. Exits non-zero when any of it goes wrong.

use mlxcel_models::{Generation, Message, Model, Prompt};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).unwrap_or("~/.cache/mlxcel/models/SmolLM2-135M-Instruct-4bit".into());
    let model = Model::load(dir).build()?;

    let question = vec![Message::user("What is the capital of France?")];
    let mut answer = String::new();
    for piece in model.generate(question.clone(), Generation::default())? {
        answer.push_str(&piece?.text);
    }
    println!("answer: {answer}");

    let ids = model.prompt_ids(&Prompt::Messages(question.clone()))?;
    let logits = model.logits(&ids)?;
    println!("{} logits after {} prompt tokens", logits.len(), ids.len());

    let mut chat = model.session();
    let (first, _) = chat.generate(question.clone(), Generation::default())?.finish()?;
    let turn_two = [question, vec![Message::assistant(&first), Message::user("And of Germany?")]].concat();
    let (second, stats) = chat.generate(turn_two, Generation::default())?.finish()?;
    println!("second turn: {second} ({} prompt tokens reused)", stats.reused_tokens);

    let elsewhere = std::thread::spawn(move || model.generate(vec![Message::user("Name a color.")], Generation::default())?.finish());
    let (color, _) = elsewhere.join().map_err(|_| "thread panicked")??;
    println!("from another thread: {color}");

    if !answer.contains("Paris") || stats.reused_tokens == 0 || color.is_empty() {
        return Err("unexpected output".into());
    }
    Ok(())
}

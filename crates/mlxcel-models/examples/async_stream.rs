//! The token stream as a `futures_core::Stream` (feature `async`), polled by a minimal
//! executor; in an application, any async runtime drives it the same way.
//!
//! `cargo run --release -p mlxcel-models --features async --example async_stream [MODEL_DIR]`

mod common;

use std::pin::Pin;

use futures_core::Stream;
use mlxcel_models::{Generation, Message, Model};

fn main() -> Result<(), mlxcel_models::Error> {
    let model = Model::load(common::model_dir()).build()?;
    let mut stream = model
        .generate(
            vec![Message::user("What is the capital of France?")],
            Generation::default(),
        )?
        .into_async();
    futures_executor::block_on(async {
        while let Some(piece) = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await
        {
            print!("{}", piece?.text);
        }
        println!();
        Ok(())
    })
}

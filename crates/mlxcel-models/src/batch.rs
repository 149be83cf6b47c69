//! Continuous batching on the model's worker. A generation request prefills its prompt as a job
//! of its own, then joins the set of running generations; between jobs the worker advances
//! every running generation by one token per step, all of those under the same adapter mix in
//! one batched forward pass ([`mlxcel_arch::generate::step_batch`]). Decode reads every weight
//! once per step whatever the batch, so a batch of eight costs little more than one sequence.
//! New requests join between steps, finished or cancelled ones leave, and each conversation
//! keeps its own caches, so the prefix reuse of [`crate::Session`] works as before.

use std::sync::Arc;

use mlxcel_arch::generate::{check_logits, step_batch, Session as ArchSession, SessionState};
use mlxcel_arch::{LanguageModel, ModelError};
use mlxcel_core::Dtype;
use mlxcel_loading::{GenerateRequest, GenerationProgress, StepHooks, Tokenizer};

use crate::worker::Background;
use crate::{AdapterMix, Error, Event, ModelState, Piece, Queue, Sessions, SharedLogitsProcessor};

/// Most generations advanced by one forward pass; more wait for the next step.
pub(crate) const MAX_BATCH: usize = 16;

/// How the worker's decode steps were batched, since the model was loaded
/// ([`crate::Model::batch_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Decode forward passes (one per step for a batch, one per generation for a model that
    /// cannot batch: [`mlxcel_arch::LanguageModel::batched_decode`]).
    pub steps: u64,
    /// Generations advanced over all passes: `rows / steps` is the mean batch size.
    pub rows: u64,
    /// The largest batch one forward pass advanced so far.
    pub largest: usize,
}

/// A generation between its steps.
pub(crate) struct Running {
    /// The conversation to park the caches in afterwards (`None`: discard them).
    session: Option<u64>,
    state: SessionState,
    progress: GenerationProgress,
    /// The token to feed at the next step.
    next: u32,
    mix: AdapterMix,
    feed: Arc<Queue>,
    /// Tokens (and their logprobs) not yet accounted for by a piece of text.
    piece: Piece,
    processor: Option<SharedLogitsProcessor>,
    logprobs: Option<usize>,
}

/// What a generation request brings to the worker.
pub(crate) struct Start {
    pub(crate) session: Option<u64>,
    pub(crate) ids: Vec<u32>,
    pub(crate) request: GenerateRequest,
    pub(crate) adapters: Option<AdapterMix>,
    pub(crate) feed: Arc<Queue>,
    pub(crate) processor: Option<SharedLogitsProcessor>,
    pub(crate) logprobs: Option<usize>,
}

impl Running {
    /// Picks the token after `logits` (`[vocab]`) and passes it on; false once the
    /// generation has ended.
    fn advance(
        &mut self,
        logits: &mlxcel_core::Array,
        device_pick: Option<u32>,
        tokenizer: Option<&Tokenizer>,
    ) -> crate::Result<bool> {
        let (token, logprob) = match device_pick {
            Some(t) => (t, None),
            None => {
                let mut guard = match &self.processor {
                    Some(p) => Some(p.0.lock().map_err(|_| {
                        Error::Invalid(
                            "the logits processor is poisoned by an earlier panic".into(),
                        )
                    })?),
                    None => None,
                };
                let mut hooks = StepHooks {
                    logprobs: self.logprobs,
                    processor: guard
                        .as_mut()
                        .map(|g| &mut **g as &mut dyn mlxcel_loading::LogitsProcessor),
                };
                self.progress
                    .pick(logits, self.state.tokens(), &mut hooks)?
            }
        };
        let (feed, piece) = (&self.feed, &mut self.piece);
        let piece = std::cell::RefCell::new(piece);
        let goes_on = self.progress.emit(
            token,
            logprob,
            tokenizer,
            |text| {
                let mut p = piece.borrow_mut();
                let mut done = std::mem::take(&mut **p);
                done.text = text.to_string();
                feed.push(Event::Piece(done));
            },
            |token, logprob| {
                let mut p = piece.borrow_mut();
                p.tokens.push(token);
                p.logprobs.extend(logprob);
                if tokenizer.is_none() {
                    feed.push(Event::Piece(std::mem::take(&mut **p)));
                }
            },
        )?;
        self.next = token;
        Ok(goes_on)
    }

    /// Whether its next step can be computed on the device alone (greedy, no hooks).
    fn device_greedy(&self) -> bool {
        self.progress.is_greedy() && self.processor.is_none() && self.logprobs.is_none()
    }

    /// Ends the generation: the rest of its text, its statistics, and its caches parked in
    /// its conversation.
    fn end(self, sessions: &mut Sessions, tokenizer: Option<&Tokenizer>) {
        let Running {
            session,
            state: caches,
            progress,
            mix,
            feed,
            mut piece,
            ..
        } = self;
        let mut texts = Vec::new();
        let result = progress.finish(tokenizer, |t| texts.push(t.to_string()));
        for text in texts {
            let mut done = std::mem::take(&mut piece);
            done.text = text;
            feed.push(Event::Piece(done));
        }
        if !piece.tokens.is_empty() {
            feed.push(Event::Piece(piece));
        }
        if let Some(id) = session {
            sessions.insert(id, (caches, mix));
        }
        feed.push(match result {
            Ok((_, stats)) => Event::Done(Box::new(stats)),
            Err(e) => Event::Failed(Error::Load(e)),
        });
    }
}

impl ModelState {
    /// Prefills a request's prompt and takes its first token; the generation then runs with
    /// the others ([`Background::work`]) unless that token already ended it.
    pub(crate) fn start(&mut self, start: Start) {
        let Start {
            session,
            ids,
            request,
            adapters,
            feed,
            processor,
            logprobs,
        } = start;
        let mix = match self.select(adapters.as_ref()) {
            Ok(mix) => mix,
            Err(e) => return feed.push(Event::Failed(e)),
        };
        // Caches computed under another adapter mix are not reused.
        let state = match session.and_then(|id| self.sessions.remove(&id)) {
            Some((state, cached_mix)) if cached_mix == mix => state,
            _ => SessionState::new(&self.loaded.model),
        };
        let ModelState {
            loaded,
            sessions,
            running,
            tokenizer,
            ..
        } = self;
        let tokenizer = tokenizer.as_deref();
        let mut s =
            ArchSession::resume(&loaded.model, state).with_mapped_files(loaded.mapped.clone());
        let (progress, logits) =
            match GenerationProgress::start(&mut s, &ids, request, tokenizer.is_some()) {
                Ok(started) => started,
                Err(e) => return feed.push(Event::Failed(Error::Load(e))),
            };
        let mut new = Running {
            session,
            state: s.into_state(),
            progress,
            next: 0,
            mix,
            feed,
            piece: Piece::default(),
            processor,
            logprobs,
        };
        match new.advance(&logits, None, tokenizer) {
            Ok(true) => running.push_back(new),
            Ok(false) => new.end(sessions, tokenizer),
            Err(e) => new.feed.push(Event::Failed(e)),
        }
    }

    /// Drops conversation `id`'s caches, and those of its generation still running when it
    /// ends (a dropped [`crate::Session`] is never resumed).
    pub(crate) fn forget_session(&mut self, id: u64) {
        self.sessions.remove(&id);
        for r in self.running.iter_mut().filter(|r| r.session == Some(id)) {
            r.session = None;
        }
    }

    /// One step of the generations at the front of the queue that share its adapter mix.
    fn step(&mut self) {
        let Some(front) = self.running.front() else {
            return;
        };
        let mix = front.mix.clone();
        if let Err(e) = self.select(Some(&mix)) {
            let failed = self.running.pop_front().map(|r| r.feed);
            if let Some(feed) = failed {
                feed.push(Event::Failed(e));
            }
            return;
        }
        let mut batch = Vec::new();
        let mut others = std::collections::VecDeque::new();
        while let Some(r) = self.running.pop_front() {
            if r.mix == mix && batch.len() < MAX_BATCH {
                batch.push(r);
            } else {
                others.push_back(r);
            }
        }
        // The rest go first next time, so every mix gets its turn.
        self.running = others;
        let passes = if self.loaded.model.batched_decode() {
            1
        } else {
            batch.len()
        };
        self.batching.steps += passes as u64;
        self.batching.rows += batch.len() as u64;
        self.batching.largest = self.batching.largest.max(batch.len() / passes);
        let ModelState {
            loaded,
            sessions,
            running,
            tokenizer,
            ..
        } = self;
        let tokenizer = tokenizer.as_deref();
        let tokens: Vec<u32> = batch.iter().map(|r| r.next).collect();
        let any_device_greedy = batch.iter().any(Running::device_greedy);
        let mut states: Vec<&mut SessionState> = batch.iter_mut().map(|r| &mut r.state).collect();
        let model: &dyn LanguageModel = &loaded.model;
        let stepped = step_batch(model, &mut states, &tokens).and_then(|logits| {
            // Greedy rows without hooks pick on the device, in one read for the batch.
            let picks = if any_device_greedy {
                let ids = logits.argmax(-1, false)?.astype(Dtype::Int32)?;
                let nan = logits.isnan()?.any(&[-1], false)?.astype(Dtype::Int32)?;
                mlxcel_core::ops::eval_all([&ids, &nan])?;
                Some((ids.to_vec::<i32>()?, nan.to_vec::<i32>()?))
            } else {
                None
            };
            Ok((logits, picks))
        });
        let (logits, picks) = match stepped {
            Ok(s) => s,
            Err(e) => {
                // The caches may be half-extended: these conversations start over next time.
                let message = e.to_string();
                for r in batch {
                    r.feed.push(Event::Failed(Error::Model(ModelError::Runtime(
                        message.clone(),
                    ))));
                }
                return;
            }
        };
        for (i, mut r) in batch.into_iter().enumerate() {
            let row = logits
                .slice_axis(0, i as i32, i as i32 + 1)
                .and_then(|a| a.reshape(&[-1]));
            let device_pick = match &picks {
                Some((ids, nan)) if r.device_greedy() => {
                    if nan[i] != 0 {
                        let at = r.progress.generated().len();
                        let error = row
                            .map_err(Error::from)
                            .and_then(|row| {
                                Ok(check_logits(&row, || format!("generation step {at}"))?)
                            })
                            .err()
                            .unwrap_or_else(|| Error::Invalid("NaN logits".into()));
                        r.feed.push(Event::Failed(error));
                        continue;
                    }
                    Some(ids[i] as u32)
                }
                _ => None,
            };
            let advanced = row
                .map_err(Error::from)
                .and_then(|row| r.advance(&row, device_pick, tokenizer));
            match advanced {
                Ok(true) => running.push_back(r),
                Ok(false) => r.end(sessions, tokenizer),
                Err(e) => r.feed.push(Event::Failed(e)),
            }
        }
    }
}

impl Background for ModelState {
    fn busy(&self) -> bool {
        !self.running.is_empty()
    }

    fn work(&mut self) {
        self.step();
    }
}

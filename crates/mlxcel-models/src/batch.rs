//! Continuous batching on the model's worker. A generation request prefills its prompt as a job
//! of its own, then joins the running generations; between jobs the worker advances them by
//! one token per step. For models that batch ([`mlxcel_arch::LanguageModel::batched_decode`])
//! the generations under one adapter mix form a [`DecodeBatch`]: their caches merged, one
//! forward pass per step for all of them (decode reads every weight once per step whatever the
//! batch). The batch is re-formed only when a generation joins or leaves; each conversation
//! then gets its own caches back, so the prefix reuse of [`crate::Session`] works as before.
//! Other models step each generation in turn ([`step_batch`]).

use std::collections::VecDeque;
use std::sync::Arc;

use mlxcel_arch::generate::{
    check_logits, step_batch, DecodeBatch, Session as ArchSession, SessionState,
};
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
        history: &[u32],
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
                self.progress.pick(logits, history, &mut hooks)?
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
    fn end(self, caches: SessionState, sessions: &mut Sessions, tokenizer: Option<&Tokenizer>) {
        let Running {
            session,
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
            progress,
            next: 0,
            mix,
            feed,
            piece: Piece::default(),
            processor,
            logprobs,
        };
        let advanced = new.advance(&logits, None, s.tokens(), tokenizer);
        let state = s.into_state();
        match advanced {
            Ok(true) => running.push_back((new, state)),
            Ok(false) => new.end(state, sessions, tokenizer),
            Err(e) => new.feed.push(Event::Failed(e)),
        }
    }

    /// Drops conversation `id`'s caches, and those of its generation still running when it
    /// ends (a dropped [`crate::Session`] is never resumed).
    pub(crate) fn forget_session(&mut self, id: u64) {
        self.sessions.remove(&id);
        let batched = self.batch.iter_mut().flat_map(|b| b.rows.iter_mut());
        for r in self.running.iter_mut().map(|(r, _)| r).chain(batched) {
            if r.session == Some(id) {
                r.session = None;
            }
        }
    }

    /// One decode step: of the batch, for a model that batches, else of the generations at the
    /// front of the queue that share its adapter mix, one after the other.
    fn step(&mut self) {
        // A lone generation with the CPU decode engine on decodes on its own caches: the engine
        // runs a step as one call, which a decode batch (even of one row) never reaches.
        let lone_on_engine = self.batch.is_none()
            && self.running.len() == 1
            && self.loaded.model.decodes_on_cpu_engine();
        if self.loaded.model.batched_decode() && !lone_on_engine {
            self.step_batch();
        } else {
            self.step_each();
        }
    }

    /// Counts a decode step of `rows` generations in `passes` forward passes.
    fn count(&mut self, rows: usize, passes: usize) {
        self.batching.steps += passes as u64;
        self.batching.rows += rows as u64;
        self.batching.largest = self.batching.largest.max(rows / passes.max(1));
    }

    fn step_each(&mut self) {
        let Some((front, _)) = self.running.front() else {
            return;
        };
        let mix = front.mix.clone();
        if let Err(e) = self.select(Some(&mix)) {
            if let Some((r, _)) = self.running.pop_front() {
                r.feed.push(Event::Failed(e));
            }
            return;
        }
        let (mut group, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|(r, _)| r.mix == mix);
        // The rest go first next time, so every mix gets its turn.
        self.running = others.into();
        self.running
            .extend(group.drain(MAX_BATCH.min(group.len())..));
        self.count(group.len(), group.len());
        let tokens: Vec<u32> = group.iter().map(|(r, _)| r.next).collect();
        let greedy = group.iter().any(|(r, _)| r.device_greedy());
        let mut states: Vec<&mut SessionState> = group.iter_mut().map(|(_, s)| s).collect();
        let model: &dyn LanguageModel = &self.loaded.model;
        let stepped = step_batch(model, &mut states, &tokens).and_then(|l| read_step(l, greedy));
        let rows = group
            .into_iter()
            .enumerate()
            .map(|(i, (r, s))| (i, r, Some(s)))
            .collect();
        // Rows with their own state go back to the queue or end inside.
        self.advance_rows(rows, stepped, None);
    }

    fn step_batch(&mut self) {
        // The batch's mix, else the front generation's.
        let mix = match (&self.batch, self.running.front()) {
            (Some(b), _) => b.mix.clone(),
            (None, Some((r, _))) => r.mix.clone(),
            (None, None) => return,
        };
        let in_batch = self.batch.as_ref().map_or(0, |b| b.rows.len());
        let joining = in_batch < MAX_BATCH && self.running.iter().any(|(r, _)| r.mix == mix);
        if joining {
            if let Some(mut batch) = self.batch.take() {
                if let Some(pending) = batch.pending.take() {
                    // Tokens still on the device are read before the batch changes; the
                    // joiners merge at the next step.
                    let read = pending.read();
                    return self.finish_step(batch, read);
                }
                self.batch = Some(batch);
            }
            self.form_batch(mix.clone());
        }
        let Some(batch) = self.batch.as_ref() else {
            return;
        };
        if let Err(e) = self.select(Some(&batch.mix)) {
            if let Some(batch) = self.batch.take() {
                for r in batch.rows {
                    r.feed.push(Event::Failed(Error::Invalid(e.to_string())));
                }
            }
            return;
        }
        let Some(mut batch) = self.batch.take() else {
            return;
        };
        // Greedy rows without hooks can take their next token on the device: the next step
        // is queued before this one's tokens are read, as the single-stream loop does, so the
        // host builds one step's graph while the device runs the previous one. Not while other
        // adapter mixes wait for a turn (the batch is split after this step).
        let others_wait = self.running.iter().any(|(r, _)| r.mix != mix);
        let pipelined = !others_wait
            && batch.rows.iter().all(Running::device_greedy)
            && mlxcel_core::policy::with(|p| p.batch_pipeline);
        match batch.pending.take() {
            Some(pending) if pipelined => {
                self.count(batch.rows.len(), 1);
                let model: &dyn LanguageModel = &self.loaded.model;
                let next = batch
                    .decode
                    .step_pending(model, &pending.ids)
                    .and_then(DevicePicks::of)
                    .and_then(|next| next.queue().map(|()| next));
                match next {
                    Ok(next) => {
                        let read = pending.read();
                        if let Ok(Stepped {
                            picks: Some((ids, _)),
                            ..
                        }) = &read
                        {
                            let fed: Vec<u32> = ids.iter().map(|t| *t as u32).collect();
                            batch.decode.record(&fed);
                        }
                        batch.pending = Some(next);
                        self.finish_step(batch, read);
                    }
                    Err(e) => self.finish_step(batch, Err(e)),
                }
            }
            Some(pending) => {
                let read = pending.read();
                self.finish_step(batch, read);
            }
            None => {
                self.count(batch.rows.len(), 1);
                let model: &dyn LanguageModel = &self.loaded.model;
                let tokens: Vec<u32> = batch.rows.iter().map(|r| r.next).collect();
                let logits = batch.decode.step(model, &tokens);
                if pipelined {
                    let queued = logits
                        .and_then(DevicePicks::of)
                        .and_then(|p| p.queue().map(|()| p));
                    match queued {
                        Ok(picks) => {
                            batch.pending = Some(picks);
                            self.batch = Some(batch);
                        }
                        Err(e) => self.finish_step(batch, Err(e)),
                    }
                } else {
                    let greedy = batch.rows.iter().any(Running::device_greedy);
                    let read = logits.and_then(|l| read_step(l, greedy));
                    self.finish_step(batch, read);
                }
            }
        }
    }

    /// Passes each row of `batch` its token from `stepped`; keeps the batch as it is when
    /// everyone goes on, else splits it: the finished generations park their caches, the
    /// others take theirs back to the queue (the batch is re-formed at the next step).
    fn finish_step(&mut self, batch: Batch, stepped: mlxcel_arch::Result<Stepped>) {
        let Batch {
            rows,
            decode,
            mix,
            pending,
        } = batch;
        let rows = rows
            .into_iter()
            .enumerate()
            .map(|(i, r)| (i, r, None))
            .collect();
        let (mut kept, mut finished) = self.advance_rows(rows, stepped, Some(&decode));
        let others_wait = self.running.iter().any(|(r, _)| r.mix != mix);
        if kept.len() == decode.len() && !others_wait {
            self.batch = Some(Batch {
                rows: kept.into_iter().map(|(_, r)| r).collect(),
                decode,
                mix,
                pending,
            });
            return;
        }
        if let Some(pending) = pending {
            // The batch splits while the survivors' next tokens are on the device: read them
            // (never fed, so each conversation's caches and tokens still agree).
            let rows = kept.into_iter().map(|(i, r)| (i, r, None)).collect();
            let (still, ended) = self.advance_rows(rows, pending.read(), Some(&decode));
            kept = still;
            finished.extend(ended);
        }
        match decode.into_states() {
            Ok(states) => {
                let mut states: Vec<Option<SessionState>> = states.into_iter().map(Some).collect();
                let tokenizer = self.tokenizer.clone();
                for (i, r) in finished {
                    if let Some(state) = states[i].take() {
                        r.end(state, &mut self.sessions, tokenizer.as_deref());
                    }
                }
                let rest: Vec<_> = kept
                    .into_iter()
                    .filter_map(|(i, r)| states[i].take().map(|s| (r, s)))
                    .collect();
                if others_wait {
                    self.running.extend(rest);
                } else {
                    for row in rest.into_iter().rev() {
                        self.running.push_front(row);
                    }
                }
            }
            Err(e) => {
                for (_, r) in finished.into_iter().chain(kept) {
                    r.feed.push(Event::Failed(Error::Model(ModelError::Runtime(
                        e.to_string(),
                    ))));
                }
            }
        }
    }

    /// Merges the batch (if any) and the waiting generations of `mix` (up to [`MAX_BATCH`])
    /// into a new batch.
    fn form_batch(&mut self, mix: AdapterMix) {
        let mut members: Vec<(Running, SessionState)> = Vec::new();
        if let Some(b) = self.batch.take() {
            match b.decode.into_states() {
                Ok(states) => members.extend(b.rows.into_iter().zip(states)),
                Err(e) => {
                    for r in b.rows {
                        r.feed.push(Event::Failed(Error::Model(ModelError::Runtime(
                            e.to_string(),
                        ))));
                    }
                }
            }
        }
        let mut rest = VecDeque::new();
        for (r, s) in std::mem::take(&mut self.running) {
            if r.mix == mix && members.len() < MAX_BATCH {
                members.push((r, s));
            } else {
                rest.push_back((r, s));
            }
        }
        self.running = rest;
        let (rows, states): (Vec<Running>, Vec<SessionState>) = members.into_iter().unzip();
        match DecodeBatch::new(&self.loaded.model, states) {
            Ok(decode) => {
                self.batch = Some(Batch {
                    rows,
                    decode,
                    mix,
                    pending: None,
                })
            }
            Err((_, states)) => {
                // Not batchable after all (it should be, by `batched_decode`): one at a time.
                for row in rows.into_iter().zip(states).rev() {
                    self.running.push_front(row);
                }
                self.step_each();
            }
        }
    }

    /// Takes each row's next token from its logits row (or its device pick) and passes it on.
    /// Rows are given with their index in the step's logits. Rows stepped on their own (`Some`
    /// state) go back to the queue or end here. Batch rows (`None`, their tokens in `batch`)
    /// come back with their index: those that go on, and those that ended (their caches are
    /// still in the batch).
    fn advance_rows(
        &mut self,
        rows: Vec<(usize, Running, Option<SessionState>)>,
        stepped: mlxcel_arch::Result<Stepped>,
        batch: Option<&DecodeBatch>,
    ) -> (IndexedRows, IndexedRows) {
        let Stepped { logits, picks } = match stepped {
            Ok(p) => p,
            Err(e) => {
                // The caches may be half-extended: these conversations start over next time.
                let message = e.to_string();
                for (_, r, _) in rows {
                    r.feed.push(Event::Failed(Error::Model(ModelError::Runtime(
                        message.clone(),
                    ))));
                }
                return (Vec::new(), Vec::new());
            }
        };
        let tokenizer = self.tokenizer.clone();
        let tokenizer = tokenizer.as_deref();
        let (mut kept, mut ended) = (Vec::new(), Vec::new());
        for (i, mut r, state) in rows {
            let history: &[u32] = match (&state, batch) {
                (Some(s), _) => s.tokens(),
                (None, Some(b)) => b.tokens(i),
                (None, None) => &[],
            };
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
                .and_then(|row| r.advance(&row, device_pick, history, tokenizer));
            match (advanced, state) {
                (Ok(true), Some(s)) => self.running.push_back((r, s)),
                (Ok(false), Some(s)) => r.end(s, &mut self.sessions, tokenizer),
                (Ok(true), None) => kept.push((i, r)),
                (Ok(false), None) => ended.push((i, r)),
                (Err(e), _) => r.feed.push(Event::Failed(e)),
            }
        }
        (kept, ended)
    }
}

/// Batch rows with their index in the batch.
type IndexedRows = Vec<(usize, Running)>;

/// Generations decoded together, and their merged caches.
pub(crate) struct Batch {
    rows: Vec<Running>,
    decode: DecodeBatch,
    mix: AdapterMix,
    /// The rows' next tokens, picked on the device and not read yet (nor fed): the batch runs
    /// one step ahead of the host (see `step_batch`).
    pending: Option<DevicePicks>,
}

/// A step's logits `[B, vocab]` with each row's greedy pick and NaN flag, still on the device.
pub(crate) struct DevicePicks {
    logits: mlxcel_core::Array,
    ids: mlxcel_core::Array,
    nan: mlxcel_core::Array,
}

impl DevicePicks {
    fn of(logits: mlxcel_core::Array) -> mlxcel_arch::Result<DevicePicks> {
        let ids = logits.argmax(-1, false)?.astype(Dtype::Int32)?;
        let nan = logits.isnan()?.any(&[-1], false)?.astype(Dtype::Int32)?;
        Ok(DevicePicks { logits, ids, nan })
    }

    /// Starts computing the picks without waiting for them.
    fn queue(&self) -> mlxcel_arch::Result<()> {
        Ok(mlxcel_core::ops::async_eval_all([&self.ids, &self.nan])?)
    }

    /// Waits for the picks and reads them.
    fn read(self) -> mlxcel_arch::Result<Stepped> {
        mlxcel_core::ops::eval_all([&self.ids, &self.nan])?;
        let picks = (self.ids.to_vec::<i32>()?, self.nan.to_vec::<i32>()?);
        Ok(Stepped {
            logits: self.logits,
            picks: Some(picks),
        })
    }
}

/// A step's logits `[B, vocab]`, and the greedy rows' picks and NaN flags read to the host
/// (when any row picks greedily on the device).
pub(crate) struct Stepped {
    logits: mlxcel_core::Array,
    picks: Option<(Vec<i32>, Vec<i32>)>,
}

/// `logits` with the device picks read, when `greedy` (some row picks on the device).
fn read_step(logits: mlxcel_core::Array, greedy: bool) -> mlxcel_arch::Result<Stepped> {
    if greedy {
        DevicePicks::of(logits)?.read()
    } else {
        Ok(Stepped {
            logits,
            picks: None,
        })
    }
}

impl Background for ModelState {
    fn busy(&self) -> bool {
        !self.running.is_empty() || self.batch.is_some()
    }

    fn work(&mut self) {
        self.step();
    }
}

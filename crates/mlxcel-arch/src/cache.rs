//! Per-layer caches and the attention masks that go with them. Each layer of a model picks its
//! cache kind (the model's [`crate::model::LayerKind`] schedule says which):
//!
//! - [`LayerCache::Standard`] keeps every position's keys and values, growing its buffers in steps.
//! - [`LayerCache::Latent`] keeps multi-head latent attention's compressed `(latent, k_pe)` pair
//!   per position (DeepSeek V2/V3): one shared "head" of `kv_lora_rank + rope` features instead
//!   of `2 · kv_heads · head_dim`. Same growth, masks and rewinding as a standard cache.
//! - [`LayerCache::State`] holds a recurrent layer's fixed-size state (a convolution window and
//!   a scan state, for state-space mixers): it cannot be cut back to an earlier position, only
//!   replaced by a snapshot.
//! - [`LayerCache::Shared`] holds nothing: the layer reads the cache of an earlier layer.
//! - [`LayerCache::Bidirectional`] serves one bidirectional pass of a decoder read as an encoder
//!   (EmbeddingGemma): it keeps nothing, and masks only padding keys (and, on sliding layers,
//!   keys farther than half the window on either side).
//! - [`LayerCache::Rotating`] serves a sliding-window layer. It never drops a row that a query of
//!   the current chunk still attends to: a chunk of `L` tokens sees the `window - 1` rows before
//!   it plus its own `L` rows, and only after the chunk is the buffer trimmed back to `window`
//!   rows. (Seed 003 describes the silent bug this avoids: a ring exactly `window` wide fed
//!   2,048-token chunks kept only the last rows, and short-prompt tests kept passing.)

use mlxcel_core::ops;
use mlxcel_core::Array;

use crate::Result;

/// How attention over the returned keys must be masked.
#[derive(Debug, Clone)]
pub enum Mask {
    /// Every query sees every key.
    None,
    /// Causal, aligned to the end of the keys.
    Causal,
    /// Boolean `[L, S]` (one sequence) or `[B, 1, L, S]` (a batch), true = attend.
    Array(Array),
    /// Additive float, broadcastable to `[B, H, L, S]`: 0 where attended, a large finite
    /// negative where hidden (finite, so a query row that sees no key stays finite).
    Additive(Array),
}

impl Mask {
    /// The boolean mask for queries at absolute positions `q0..q0+l` over keys at `k0..k0+s`,
    /// causal and limited to `window` keys per query.
    pub fn window(q0: usize, l: usize, k0: usize, s: usize, window: Option<usize>) -> Result<Mask> {
        Mask::window_with_blocks(q0, l, k0, s, window, &[])
    }

    /// [`Mask::window`], and a query inside one of `blocks` (`start..end`) also sees the later
    /// keys of its own block (see [`LayerCache::set_bidirectional_blocks`]).
    pub fn window_with_blocks(
        q0: usize,
        l: usize,
        k0: usize,
        s: usize,
        window: Option<usize>,
        blocks: &[(usize, usize)],
    ) -> Result<Mask> {
        let same_block = |a: usize, b: usize| {
            blocks
                .iter()
                .any(|&(start, end)| (start..end).contains(&a) && (start..end).contains(&b))
        };
        let keep: Vec<bool> = (0..l * s)
            .map(|f| {
                let (qp, kp) = (q0 + f / s, k0 + f % s);
                (kp <= qp && window.is_none_or(|w| qp - kp < w)) || (kp > qp && same_block(qp, kp))
            })
            .collect();
        if keep.iter().all(|k| *k) {
            return Ok(Mask::None);
        }
        Ok(Mask::Array(Array::from_slice(
            &keep,
            &[l as i32, s as i32],
        )?))
    }

    /// The boolean mask for queries at absolute positions `q0..q0+l` over keys at `k0..k0+s`,
    /// causal and limited to keys in the query's own block of `chunk` positions (Llama 4's
    /// chunked local attention: position `p` sees `⌊p / chunk⌋ · chunk ..= p`).
    pub fn chunked(q0: usize, l: usize, k0: usize, s: usize, chunk: usize) -> Result<Mask> {
        let keep: Vec<bool> = (0..l * s)
            .map(|f| {
                let (qp, kp) = (q0 + f / s, k0 + f % s);
                kp <= qp && kp / chunk == qp / chunk
            })
            .collect();
        Ok(Mask::Array(Array::from_slice(
            &keep,
            &[l as i32, s as i32],
        )?))
    }

    /// `scores` `[.., L, S]` with every position this mask hides set to -inf, for attention
    /// computed as separate ops (the fused kernel takes the mask itself). A causal mask is
    /// aligned to the end of the keys.
    pub fn hide(&self, scores: &Array) -> Result<Array> {
        let keep = match self {
            Mask::None => return Ok(scores.clone()),
            Mask::Causal => {
                let (l, s) = (scores.dim(-2)? as usize, scores.dim(-1)? as usize);
                match Mask::window(s - l, l, 0, s, None)? {
                    Mask::Array(a) => a,
                    _ => return Ok(scores.clone()),
                }
            }
            // A batch's mask `[B, 1, L, S]` against scores grouped by kv head
            // `[B, Hk, rep, L, S]`.
            Mask::Array(a) if a.ndim() == 4 && scores.ndim() == 5 => a.expand_dims(&[1])?,
            Mask::Array(a) => a.clone(),
            Mask::Additive(a) => return Ok(scores.add(&a.astype(scores.dtype()?)?)?),
        };
        Ok(ops::where_(
            &keep,
            scores,
            &scores.scalar_like(f64::NEG_INFINITY)?,
        )?)
    }
}

/// Growth step of standard caches, in positions.
const STEP: i32 = 256;

/// Keys and values of every position, `[B, H, S, D]` buffers grown in steps of 256 positions
/// (also the `(latent, k_pe)` pair of [`LayerCache::Latent`]).
#[derive(Debug, Clone, Default)]
pub struct StandardCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    /// Blocks of positions attended bidirectionally during the next updates (see
    /// [`LayerCache::set_bidirectional_blocks`]).
    blocks: Vec<(usize, usize)>,
    /// Set while `keys` and `values` are buffers this cache made for the GPU decode step and
    /// no other cache shares (see [`StandardCache::owned_decode_buffers`]): cloning the cache
    /// clones the token, and a graph update drops it.
    owner: Option<std::sync::Arc<()>>,
    /// Set while `keys` and `values` may share memory with a first prompt's own key and value
    /// arrays ([`first_rows`] of a prompt filling whole growth steps); an engine that writes
    /// rows in place copies them first.
    prompt_rows: bool,
}

/// Keys and values of a sliding-window layer: a ring of `window` rows (plus, during a chunk,
/// that chunk's rows; see the module docs).
#[derive(Debug, Clone)]
pub struct RotatingCache {
    window: usize,
    keys: Option<Array>,
    values: Option<Array>,
    /// Ring position of the oldest row once the buffer is full and written in place.
    start: usize,
    offset: usize,
    /// See [`StandardCache::blocks`].
    blocks: Vec<(usize, usize)>,
}

/// The fixed-size state of a recurrent layer (state-space mixers): whatever arrays the mixer
/// keeps, and how many positions they summarise.
#[derive(Debug, Clone, Default)]
pub struct StateCache {
    /// The mixer's state arrays, in the mixer's own order (`None` before the first token).
    pub arrays: Vec<Option<Array>>,
    offset: usize,
}

impl StateCache {
    /// Records that the state now summarises `positions` more tokens.
    pub fn advance(&mut self, positions: usize) {
        self.offset += positions;
    }
}

/// One layer's cache.
#[derive(Debug, Clone)]
pub enum LayerCache {
    /// Every position's keys and values (global attention).
    Standard(StandardCache),
    /// A sliding-window ring (sliding-window attention).
    Rotating(RotatingCache),
    /// Multi-head latent attention's compressed latent and rope key per position.
    Latent(StandardCache),
    /// A recurrent layer's fixed-size state.
    State(StateCache),
    /// Reads layer `source`'s cache (KV sharing); its own offset follows the model's.
    Shared {
        /// Index of the layer whose cache this one reads.
        source: usize,
        /// Positions processed so far.
        offset: usize,
    },
    /// The same layer's keys and values of several conversations decoded as one batch
    /// ([`crate::generate::DecodeBatch`]). Only attention layers take it
    /// ([`crate::LanguageModel::batched_decode`] says whether a model's layers all do).
    Batch(BatchCache),
    /// One bidirectional pass (see [`LayerCache::bidirectional`]).
    Bidirectional(BidirectionalCache),
    /// A layer running attention and a recurrent mixer side by side (Falcon-H1): the
    /// attention's keys and values (a standard cache), then the mixer's state. It rewinds no
    /// further than its state; a snapshot keeps only the state and the keys are cut back.
    Pair(Box<(LayerCache, LayerCache)>),
}

/// A bidirectional pass over right-padded rows: no keys are kept; the mask hides padding keys.
#[derive(Debug, Clone)]
pub struct BidirectionalCache {
    /// `[B, S]` int, 1 = real token.
    keep: Array,
    offset: usize,
}

fn rows(a: &Option<Array>) -> Result<usize> {
    Ok(match a {
        Some(a) => a.dim(2)? as usize,
        None => 0,
    })
}

/// A key or value buffer with room for more positions (axis 2): `old`'s first `keep` rows, then
/// zero rows up to `cap`, shaped and typed like `like` but for axis 2. Caches grow by whole
/// [`STEP`]s so that most steps write in place ([`write_rows`]).
fn grow_rows(old: Option<&Array>, keep: usize, cap: usize, like: &Array) -> Result<Array> {
    let mut shape = like.shape();
    shape[2] = (cap - keep) as i32;
    let fresh = ops::zeros(&shape, like.dtype()?)?;
    Ok(match old {
        Some(o) => ops::concatenate(&[o.slice_axis(2, 0, keep as i32)?, fresh], 2)?,
        None => fresh,
    })
}

/// A fresh cache's buffer for a first prompt's rows `new` (`[B, H, L, D]`): `new` itself, dense,
/// when `cap` equals L, else `new` followed by zero rows up to `cap`. Either way one op, where
/// growing an empty buffer and then writing the prompt into it ([`grow_rows`], [`write_rows`])
/// is a zero fill and two copies: on a GPU prompt of 512 ids that was four kernels a layer.
/// The result is laid out as [`grow_rows`]' buffer would be (dense, `cap` rows), so attention
/// reads the same layout; it may share `new`'s memory (see `StandardCache::prompt_rows`).
fn first_rows(new: &Array, cap: usize) -> Result<Array> {
    let l = new.dim(2)? as usize;
    if l == cap {
        return Ok(new.contiguous()?);
    }
    let mut shape = new.shape();
    shape[2] = (cap - l) as i32;
    Ok(ops::concatenate(
        &[new.clone(), ops::zeros(&shape, new.dtype()?)?],
        2,
    )?)
}

/// `buf` with `new`'s positions (axis 2) written from row `at` on.
fn write_rows(buf: &Array, new: &Array, at: usize) -> Result<Array> {
    let mut stop = buf.shape();
    stop[2] = (at + new.dim(2)? as usize) as i32;
    Ok(buf.slice_update(new, &[0, 0, at as i32, 0], &stop, &[1, 1, 1, 1])?)
}

impl LayerCache {
    /// An empty cache that keeps every position (global attention).
    pub fn standard() -> LayerCache {
        LayerCache::Standard(StandardCache::default())
    }

    /// The compressed cache of multi-head latent attention.
    pub fn latent() -> LayerCache {
        LayerCache::Latent(StandardCache::default())
    }

    /// An empty recurrent state.
    pub fn state() -> LayerCache {
        LayerCache::State(StateCache::default())
    }

    /// An empty [`LayerCache::Pair`]: keys and values for every position, and a state.
    pub fn attention_and_state() -> LayerCache {
        LayerCache::Pair(Box::new((LayerCache::standard(), LayerCache::state())))
    }

    /// The attention cache and the state of a [`LayerCache::Pair`].
    pub fn pair_mut(&mut self) -> Result<(&mut LayerCache, &mut LayerCache)> {
        match self {
            LayerCache::Pair(pair) => {
                let (kv, state) = &mut **pair;
                Ok((kv, state))
            }
            other => Err(other.wrong_kind("parallel attention and state-space")),
        }
    }

    /// Whether the cache holds a recurrent state (prefix reuse across a divergence restores a
    /// snapshot of it instead of rewinding).
    pub fn is_recurrent(&self) -> bool {
        matches!(self, LayerCache::State(_) | LayerCache::Pair(_))
    }

    /// What a prefix-reuse snapshot keeps of this cache: recurrent states and sliding-window
    /// rings (which cannot be cut back once moved on, and are as small as a state); a pair's
    /// state (its keys and values are cut back instead); `None` for caches that rewind.
    pub fn snapshot(&self) -> Option<LayerCache> {
        match self {
            LayerCache::State(_) | LayerCache::Rotating(_) => Some(self.clone()),
            LayerCache::Pair(pair) => Some(LayerCache::Pair(Box::new((
                LayerCache::standard(),
                pair.1.clone(),
            )))),
            _ => None,
        }
    }

    /// Whether [`LayerCache::restore`] of a snapshot taken at `position` can put this cache
    /// back (a pair's keys and values must reach back to it).
    pub fn can_restore(&self, position: usize) -> bool {
        match self {
            LayerCache::Pair(pair) => pair.0.can_rewind(position),
            _ => true,
        }
    }

    /// Puts the cache back to `snapshot` (from [`LayerCache::snapshot`]) taken at `position`.
    pub fn restore(&mut self, snapshot: LayerCache, position: usize) -> Result<()> {
        match (self, snapshot) {
            (LayerCache::Pair(pair), LayerCache::Pair(saved)) => {
                pair.0.rewind(position)?;
                pair.1 = saved.1;
            }
            (cache, snapshot) => *cache = snapshot,
        }
        Ok(())
    }

    /// A cache that reads layer `source`'s cache instead of holding its own.
    pub fn shared(source: usize) -> LayerCache {
        LayerCache::Shared { source, offset: 0 }
    }

    /// A cache for one bidirectional pass over `keep` `[B, S]` (int, 1 = real token): every
    /// query attends to every real key; on a layer with a window of `W` keys, to those at most
    /// `W / 2` positions away on either side (transformers' bidirectional Gemma 3 turns its
    /// `sliding_window` into the exclusive bound `W / 2 + 1`). A second update is an error.
    pub fn bidirectional(keep: Array) -> LayerCache {
        LayerCache::Bidirectional(BidirectionalCache { keep, offset: 0 })
    }

    /// An empty sliding-window ring keeping the last `window` positions.
    pub fn rotating(window: usize) -> LayerCache {
        LayerCache::Rotating(RotatingCache {
            window,
            keys: None,
            values: None,
            start: 0,
            offset: 0,
            blocks: Vec::new(),
        })
    }

    /// Makes the next updates of a key/value cache (standard or sliding-window) let every
    /// query inside one of `blocks` (absolute positions `start..end`) also see the later keys
    /// of its own block, on top of causal (and window) masking: the bidirectional attention
    /// over image tokens of Gemma 3's text decoder (transformers' `blockwise_overlay`:
    /// `OR(causal, same block)`, within the window on sliding layers). An empty list restores
    /// plain causal masks; other cache kinds are left as they are.
    pub fn set_bidirectional_blocks(&mut self, blocks: &[(usize, usize)]) {
        match self {
            LayerCache::Standard(c) | LayerCache::Latent(c) => c.blocks = blocks.to_vec(),
            LayerCache::Rotating(c) => c.blocks = blocks.to_vec(),
            _ => {}
        }
    }

    /// Positions processed so far.
    pub fn offset(&self) -> usize {
        match self {
            LayerCache::Standard(c) | LayerCache::Latent(c) => c.offset,
            LayerCache::Rotating(c) => c.offset,
            LayerCache::State(c) => c.offset,
            LayerCache::Shared { offset, .. } => *offset,
            // Each row has its own ([`BatchCache::positions`]); the furthest is the batch's.
            LayerCache::Batch(b) => b.positions.iter().copied().max().unwrap_or(0),
            LayerCache::Bidirectional(c) => c.offset,
            LayerCache::Pair(pair) => pair.1.offset(),
        }
    }

    pub(crate) fn kind_name(&self) -> &'static str {
        match self {
            LayerCache::Standard(_) => "standard KV",
            LayerCache::Rotating(_) => "rotating KV",
            LayerCache::Latent(_) => "latent KV",
            LayerCache::State(_) => "state",
            LayerCache::Shared { .. } => "shared",
            LayerCache::Batch(_) => "batched",
            LayerCache::Bidirectional(_) => "bidirectional",
            LayerCache::Pair(_) => "attention and state",
        }
    }

    fn wrong_kind(&self, wanted: &str) -> crate::ModelError {
        crate::ModelError::Runtime(format!(
            "a {wanted} layer was given a {} cache (caches must come from the model's make_caches)",
            self.kind_name()
        ))
    }

    /// Appends `k`, `v` (`[B, H, L, D]`) and returns the keys, values and mask the `L` new queries
    /// attend over. `window` limits each query to that many most recent keys (sliding-window
    /// layers held in a standard cache).
    pub fn update(
        &mut self,
        k: &Array,
        v: &Array,
        window: Option<usize>,
    ) -> Result<(Array, Array, Mask)> {
        match self {
            LayerCache::Standard(c) => c.update(k, v, window),
            LayerCache::Rotating(c) => c.update(k, v),
            LayerCache::Batch(b) => b.update(k, v, window),
            LayerCache::Bidirectional(c) => c.update(k, v, window),
            _ => Err(self.wrong_kind("key/value attention")),
        }
    }

    /// Appends multi-head latent attention's normalised latent `[B, 1, L, rank]` and roped key
    /// part `[B, 1, L, rope]`; returns every cached pair and the mask of the `L` new queries.
    pub fn update_latent(&mut self, latent: &Array, k_pe: &Array) -> Result<(Array, Array, Mask)> {
        match self {
            LayerCache::Latent(c) => c.update(latent, k_pe, None),
            _ => Err(self.wrong_kind("latent attention")),
        }
    }

    /// The earliest position the cache can be cut back to: 0 for caches that keep every
    /// position; for a ring, the first position whose window it still holds in full; for a
    /// recurrent state, only its current position (a state cannot be un-applied).
    pub fn rewind_floor(&self) -> usize {
        match self {
            LayerCache::Standard(_) | LayerCache::Latent(_) | LayerCache::Shared { .. } => 0,
            LayerCache::Rotating(c) => {
                let held = rows(&c.keys).unwrap_or(0);
                let oldest = c.offset - held;
                if oldest == 0 {
                    0
                } else {
                    oldest + c.window - 1
                }
            }
            LayerCache::State(c) => c.offset,
            // A batch's rows are cut back one by one, once split ([`BatchCache::split`]).
            LayerCache::Batch(_) => usize::MAX,
            LayerCache::Bidirectional(c) => c.offset,
            LayerCache::Pair(pair) => pair.0.rewind_floor().max(pair.1.rewind_floor()),
        }
    }

    /// Whether the cache can be cut back to its first `position` tokens (see
    /// [`LayerCache::rewind_floor`]).
    pub fn can_rewind(&self, position: usize) -> bool {
        self.rewind_floor() <= position && position <= self.offset()
    }

    /// Whether, after `extra` more positions, the cache could still be cut back to where it is
    /// now (speculative decoding feeds draft tokens it may have to take back): caches that keep
    /// every position can; a sliding-window ring only while nothing has left its window yet; a
    /// recurrent state never (it cannot be un-applied).
    pub fn can_take_back(&self, extra: usize) -> bool {
        match self {
            LayerCache::Standard(_) | LayerCache::Latent(_) | LayerCache::Shared { .. } => true,
            LayerCache::Rotating(c) => c.offset + extra <= c.window,
            LayerCache::State(_) | LayerCache::Batch(_) | LayerCache::Bidirectional(_) => false,
            LayerCache::Pair(pair) => pair.0.can_take_back(extra) && pair.1.can_take_back(extra),
        }
    }

    /// Cuts the cache back to its first `position` tokens (see [`LayerCache::can_rewind`]).
    pub fn rewind(&mut self, position: usize) -> Result<()> {
        if !self.can_rewind(position) {
            return Err(crate::ModelError::Runtime(format!(
                "a {} cache at position {} cannot rewind to {position} (earliest: {})",
                self.kind_name(),
                self.offset(),
                self.rewind_floor()
            )));
        }
        match self {
            // Rows past the offset are overwritten by the next update.
            LayerCache::Standard(c) | LayerCache::Latent(c) => c.offset = position,
            // `can_rewind` allowed only the current position.
            LayerCache::State(_) | LayerCache::Bidirectional(_) | LayerCache::Pair(_) => {}
            LayerCache::Shared { offset, .. } => *offset = position,
            LayerCache::Batch(_) => unreachable!("can_rewind refuses a batch"),
            LayerCache::Rotating(c) => {
                let held = rows(&c.keys)?;
                let keep = (position - (c.offset - held)) as i32;
                let cut = |buf: &Option<Array>| -> Result<Option<Array>> {
                    buf.as_ref()
                        .map(|b| Ok(c.ordered(b)?.slice_axis(2, 0, keep)?))
                        .transpose()
                };
                let (k, v) = (cut(&c.keys)?, cut(&c.values)?);
                c.keys = if keep > 0 { k } else { None };
                c.values = if keep > 0 { v } else { None };
                c.start = 0;
                c.offset = position;
            }
        }
        Ok(())
    }

    /// The arrays the cache holds (keys and values, or a state's arrays).
    pub fn planes(&self) -> Vec<&Array> {
        let planes: Vec<&Option<Array>> = match self {
            LayerCache::Standard(c) | LayerCache::Latent(c) => vec![&c.keys, &c.values],
            LayerCache::Rotating(c) => vec![&c.keys, &c.values],
            LayerCache::State(c) => c.arrays.iter().collect(),
            LayerCache::Shared { .. } | LayerCache::Bidirectional(_) => vec![],
            LayerCache::Batch(b) => return vec![&b.keys, &b.values],
            LayerCache::Pair(pair) => {
                let mut planes = pair.0.planes();
                planes.extend(pair.1.planes());
                return planes;
            }
        };
        planes.into_iter().flatten().collect()
    }

    /// Bytes held by the cache buffers.
    pub fn nbytes(&self) -> usize {
        self.planes().into_iter().map(Array::nbytes).sum()
    }

    /// Moves a shared cache's position along with its source layer's.
    pub fn follow(&mut self, positions: usize) {
        if let LayerCache::Shared { offset, .. } = self {
            *offset += positions;
        }
    }
}

impl StandardCache {
    fn update(
        &mut self,
        k: &Array,
        v: &Array,
        window: Option<usize>,
    ) -> Result<(Array, Array, Mask)> {
        let prev = self.offset;
        let l = k.dim(2)? as usize;
        let end = prev + l;
        let cap = end.div_ceil(STEP as usize) * STEP as usize;
        let (keys, values) = if prev == 0 && self.keys.is_none() && self.values.is_none() {
            // Only a prompt filling whole steps is its own buffer; a shorter one is copied.
            self.prompt_rows = end == cap;
            (first_rows(k, cap)?, first_rows(v, cap)?)
        } else {
            if end > rows(&self.keys)? {
                self.keys = Some(grow_rows(self.keys.as_ref(), prev, cap, k)?);
                self.values = Some(grow_rows(self.values.as_ref(), prev, cap, v)?);
            }
            self.prompt_rows = false;
            (
                write_rows(self.keys.as_ref().expect("grown above"), k, prev)?,
                write_rows(self.values.as_ref().expect("grown above"), v, prev)?,
            )
        };
        self.owner = None;
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        self.offset = end;
        // Only the rows a query of this step can see: all of them, or the last window + L - 1.
        let first = match window {
            Some(w) => end.saturating_sub(w + l - 1),
            None => 0,
        };
        let k_out = keys.slice_axis(2, first as i32, end as i32)?;
        let v_out = values.slice_axis(2, first as i32, end as i32)?;
        let bidirectional = self.blocks.iter().any(|&(s, e)| s < end && e > prev);
        let mask = if l == 1 && window.is_none_or(|w| end - first <= w) {
            Mask::None
        } else if window.is_none() && !bidirectional {
            Mask::Causal
        } else {
            Mask::window_with_blocks(prev, l, first, end - first, window, &self.blocks)?
        };
        Ok((k_out, v_out, mask))
    }
}

impl StandardCache {
    /// For the CPU decode engine: the key and value buffers with room for one more row (grown
    /// like [`StandardCache::update`] grows them, `[1, kv_heads, capacity, head_dim]` in `like`'s
    /// dtype) and the row it goes to. The engine writes the row into the buffers in place;
    /// [`StandardCache::advance_one`] then records it.
    pub(crate) fn decode_buffers(&mut self, like: &Array) -> Result<(&Array, &Array, usize)> {
        let prev = self.offset;
        // A cache split from a decode batch holds strided views of the batch's buffers
        // ([`BatchCache::split`]); the engine needs dense ones, so those are copied once.
        let strided = |a: &Option<Array>| -> Result<bool> {
            match a {
                Some(a) => {
                    a.eval()?;
                    Ok(!a.is_row_contiguous()?)
                }
                None => Ok(false),
            }
        };
        if self.prompt_rows
            || prev + 1 > rows(&self.keys)?
            || strided(&self.keys)?
            || strided(&self.values)?
        {
            let cap = (prev + 1).div_ceil(STEP as usize) * STEP as usize;
            let keys = grow_rows(self.keys.as_ref(), prev, cap, like)?;
            let values = grow_rows(self.values.as_ref(), prev, cap, like)?;
            keys.eval()?;
            values.eval()?;
            self.keys = Some(keys);
            self.values = Some(values);
            self.prompt_rows = false;
        }
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Ok((k, v, prev)),
            _ => Err(crate::ModelError::Runtime(
                "internal: cache grown above".into(),
            )),
        }
    }

    /// For the GPU decode step, which writes row `offset` of the buffers in place when it runs,
    /// later: the key and value buffers with room for one more row (`[1, kv_heads, capacity,
    /// head_dim]` in `like`'s dtype, dense) and that row. MLX cannot tell whether a buffer is
    /// shared while earlier steps are still in flight (they hold it too), so the cache owns its
    /// buffers outright: unless it made them itself and nothing has cloned it since, it copies
    /// the rows it holds into new buffers first (after a prompt, a graph step, a clone, and at
    /// each growth step of [`STEP`] rows).
    pub(crate) fn owned_decode_buffers(&mut self, like: &Array) -> Result<(Array, Array, usize)> {
        let prev = self.offset;
        let owned = self
            .owner
            .as_ref()
            .is_some_and(|o| std::sync::Arc::strong_count(o) == 1);
        let typed = |a: &Option<Array>| -> Result<bool> {
            Ok(a.as_ref().map(Array::dtype).transpose()? == Some(like.dtype()?))
        };
        if !owned || prev + 1 > rows(&self.keys)? || !typed(&self.keys)? || !typed(&self.values)? {
            let cap = (prev + 1).div_ceil(STEP as usize) * STEP as usize;
            let fresh = |old: Option<&Array>| -> Result<Array> {
                let old = old.map(|o| o.astype(like.dtype()?)).transpose()?;
                // Zeros alone are a broadcast scalar, not a buffer of their own.
                let a = grow_rows(old.as_ref(), prev, cap, like)?.contiguous()?;
                a.eval()?;
                Ok(a)
            };
            let keys = fresh(self.keys.as_ref())?;
            let values = fresh(self.values.as_ref())?;
            if !keys.is_row_contiguous()? || !values.is_row_contiguous()? {
                return Err(crate::ModelError::Runtime(
                    "internal: a new cache buffer is not dense".into(),
                ));
            }
            self.keys = Some(keys);
            self.values = Some(values);
            self.owner = Some(std::sync::Arc::new(()));
            self.prompt_rows = false;
        }
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Ok((k.clone(), v.clone(), prev)),
            _ => Err(crate::ModelError::Runtime(
                "internal: cache made above".into(),
            )),
        }
    }

    /// Records the row the CPU decode engine wrote.
    pub(crate) fn advance_one(&mut self) {
        self.offset += 1;
    }
}

impl BidirectionalCache {
    fn update(
        &mut self,
        k: &Array,
        v: &Array,
        window: Option<usize>,
    ) -> Result<(Array, Array, Mask)> {
        let l = k.dim(2)? as usize;
        if self.offset != 0 || self.keep.dim(1)? as usize != l {
            return Err(crate::ModelError::Runtime(format!(
                "a bidirectional pass covers its {} positions at once (given {l} after {})",
                self.keep.dim(1)?,
                self.offset
            )));
        }
        self.offset = l;
        let half = window.map(|w| (w / 2) as i32);
        let mask = crate::embedding::attention_mask(&self.keep, k.dtype()?, half)?;
        Ok((k.clone(), v.clone(), Mask::Additive(mask)))
    }
}

impl RotatingCache {
    /// The buffer in temporal order.
    fn ordered(&self, a: &Array) -> Result<Array> {
        if self.start == 0 {
            return Ok(a.clone());
        }
        let n = a.dim(2)?;
        Ok(ops::concatenate(
            &[
                a.slice_axis(2, self.start as i32, n)?,
                a.slice_axis(2, 0, self.start as i32)?,
            ],
            2,
        )?)
    }

    fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Mask)> {
        let l = k.dim(2)? as usize;
        let w = self.window;
        let held = rows(&self.keys)?;
        if l == 1 && held == w {
            // Full ring, one token: overwrite the oldest row in place; every held row is inside
            // the window of the new query, so no mask and no ordering are needed.
            let keys = write_rows(
                self.keys.as_ref().expect("held == window > 0"),
                k,
                self.start,
            )?;
            let values = write_rows(
                self.values.as_ref().expect("held == window > 0"),
                v,
                self.start,
            )?;
            self.start = (self.start + 1) % w;
            self.offset += 1;
            self.keys = Some(keys.clone());
            self.values = Some(values.clone());
            return Ok((keys, values, Mask::None));
        }
        // A chunk (or a ring not yet full): the previous window - 1 rows in order, then the new
        // rows. The returned keys cover every row any of the L queries attends to.
        let keep = held.min(w - 1);
        let join = |buf: &Option<Array>, new: &Array| -> Result<Array> {
            Ok(match buf {
                Some(b) => {
                    let b = self.ordered(b)?;
                    let n = b.dim(2)?;
                    ops::concatenate(&[b.slice_axis(2, n - keep as i32, n)?, new.clone()], 2)?
                }
                None => new.clone(),
            })
        };
        let keys = join(&self.keys, k)?;
        let values = join(&self.values, v)?;
        let total = keep + l;
        let mask = Mask::window_with_blocks(
            self.offset,
            l,
            self.offset - keep,
            total,
            Some(w),
            &self.blocks,
        )?;
        // Trim back to the window only now that the chunk's queries have their rows.
        let stored = total.min(w) as i32;
        self.keys = Some(keys.slice_axis(2, total as i32 - stored, total as i32)?);
        self.values = Some(values.slice_axis(2, total as i32 - stored, total as i32)?);
        self.start = 0;
        self.offset += l;
        Ok((keys, values, mask))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(a: &Array) -> Vec<f32> {
        a.to_vec::<f32>().unwrap()
    }

    /// Keys whose single feature is their absolute position.
    fn keys(from: usize, l: usize) -> Array {
        let v: Vec<f32> = (from..from + l).map(|p| p as f32).collect();
        Array::from_slice(&v, &[1, 1, l as i32, 1]).unwrap()
    }

    #[test]
    fn rotating_cache_keeps_every_row_a_chunk_needs() {
        let w = 8;
        for chunk in [1usize, 3, 8, 16, 64] {
            let mut cache = LayerCache::rotating(w);
            let total = 70;
            let mut pos = 0;
            while pos < total {
                let l = chunk.min(total - pos);
                let (k, _, mask) = cache.update(&keys(pos, l), &keys(pos, l), None).unwrap();
                let got = rows_of(&k);
                let mask_keep: Vec<bool> = match &mask {
                    Mask::Array(m) => m.to_vec::<bool>().unwrap(),
                    _ => vec![true; l * got.len()],
                };
                for q in 0..l {
                    let qp = pos + q;
                    // Every key in the query's window is present and unmasked...
                    for needed in qp.saturating_sub(w - 1)..=qp {
                        let j = got.iter().position(|p| *p as usize == needed);
                        let j = j.unwrap_or_else(|| {
                            panic!("chunk {chunk}: row {needed} missing for query {qp}")
                        });
                        assert!(
                            mask_keep[q * got.len() + j],
                            "chunk {chunk}: row {needed} masked for {qp}"
                        );
                    }
                    // ...and nothing outside it is visible.
                    for (j, p) in got.iter().enumerate() {
                        let p = *p as usize;
                        if mask_keep[q * got.len() + j] {
                            assert!(p <= qp && qp - p < w, "chunk {chunk}: query {qp} sees {p}");
                        }
                    }
                }
                pos += l;
            }
            assert_eq!(cache.offset(), total);
        }
    }

    /// The buffers the GPU decode step writes in place belong to one cache only: the cache makes
    /// its own copy after a graph update and after a clone, keeps it across steps (no copy per
    /// token), keeps the rows it holds and grows by whole steps.
    #[test]
    fn decode_buffers_the_gpu_step_writes_are_owned_by_one_cache() {
        let owned = |c: &mut LayerCache| -> (usize, usize, Vec<f32>, usize) {
            let LayerCache::Standard(s) = c else {
                unreachable!()
            };
            let like = Array::from_slice(&[0.0f32], &[1, 1, 1, 1]).unwrap();
            let (k, v, at) = s.owned_decode_buffers(&like).unwrap();
            assert!(k.is_row_contiguous().unwrap() && v.is_row_contiguous().unwrap());
            (
                k.data_address().unwrap(),
                k.dim(2).unwrap() as usize,
                rows_of(&k),
                at,
            )
        };
        let step = |c: &mut LayerCache| {
            let LayerCache::Standard(s) = c else {
                unreachable!()
            };
            s.advance_one();
        };
        let mut cache = LayerCache::standard();
        let (graph_keys, _, _) = cache.update(&keys(0, 5), &keys(0, 5), None).unwrap();
        graph_keys.eval().unwrap();
        let graph_buffer = graph_keys.data_address().unwrap();
        // After a graph update: new buffers, the rows held copied, room for the next row.
        let (first, cap, held, at) = owned(&mut cache);
        assert_ne!(first, graph_buffer);
        assert_eq!((cap, at), (256, 5));
        assert_eq!(&held[..5], &[0., 1., 2., 3., 4.]);
        // The next steps write into the same buffers.
        step(&mut cache);
        assert_eq!(owned(&mut cache).0, first);
        step(&mut cache);
        assert_eq!(owned(&mut cache).0, first);
        // A clone shares the buffers: the first of the two to step makes its own copy, after
        // which the other holds the old ones alone and keeps them.
        let mut clone = cache.clone();
        let (mine, ..) = owned(&mut cache);
        let (theirs, ..) = owned(&mut clone);
        assert!(mine != first && theirs == first);
        drop(clone);
        assert_eq!(owned(&mut cache).0, mine);
        // A graph update hands its buffers out as views: the next step copies again.
        cache.update(&keys(7, 2), &keys(7, 2), None).unwrap();
        let (after_graph, _, held, at) = owned(&mut cache);
        assert_ne!(after_graph, mine);
        assert_eq!((at, held[7], held[8]), (9, 7., 8.));
        // Full buffers grow by a whole step, keeping every row.
        let mut long = LayerCache::standard();
        long.update(&keys(0, 256), &keys(0, 256), None).unwrap();
        let (_, cap, held, at) = owned(&mut long);
        assert_eq!((cap, at, held[255]), (512, 256, 255.));
    }

    #[test]
    fn a_first_prompt_becomes_the_buffer_without_a_fill_or_a_copy() {
        let buffers = |c: &LayerCache| -> (Array, Array) {
            let LayerCache::Standard(s) = c else {
                unreachable!()
            };
            (s.keys.clone().unwrap(), s.values.clone().unwrap())
        };
        // A whole growth step of rows: the prompt's own (dense) array is the buffer.
        let prompt = keys(0, 256);
        prompt.eval().unwrap();
        let mut cache = LayerCache::standard();
        let (k, v, mask) = cache.update(&prompt, &keys(1000, 256), None).unwrap();
        assert!(matches!(mask, Mask::Causal));
        k.eval().unwrap();
        assert_eq!(k.data_address().unwrap(), prompt.data_address().unwrap());
        assert_eq!(rows_of(&k), rows_of(&prompt));
        assert_eq!(rows_of(&v)[255], 1255.);
        // A strided prompt (a transposed view) comes out dense, as a grown buffer would.
        let strided = keys(0, 256)
            .reshape(&[1, 256, 1, 1])
            .unwrap()
            .transpose(&[0, 2, 1, 3])
            .unwrap();
        let mut other = LayerCache::standard();
        let (k, ..) = other.update(&strided, &strided, None).unwrap();
        k.eval().unwrap();
        assert!(k.is_row_contiguous().unwrap());
        assert_eq!(rows_of(&k), rows_of(&prompt));
        // Fewer rows: zero rows after them up to the step, the prompt's rows handed out.
        let mut short = LayerCache::standard();
        let (k, _, _) = short.update(&keys(0, 5), &keys(0, 5), None).unwrap();
        assert_eq!(rows_of(&k), vec![0., 1., 2., 3., 4.]);
        let (held, _) = buffers(&short);
        assert_eq!(held.dim(2).unwrap(), 256);
        assert!(rows_of(&held)[5..].iter().all(|&x| x == 0.));
        // The next update writes after them as before.
        let (k, _, _) = short.update(&keys(5, 2), &keys(5, 2), None).unwrap();
        assert_eq!(rows_of(&k), vec![0., 1., 2., 3., 4., 5., 6.]);
        // The CPU decode engine writes rows in place: rewound inside the prompt, it must get
        // buffers of its own, not the prompt's array.
        cache.rewind(100).unwrap();
        let LayerCache::Standard(s) = &mut cache else {
            unreachable!()
        };
        let (engine_keys, _, at) = s.decode_buffers(&prompt).unwrap();
        assert_eq!(at, 100);
        assert_ne!(
            engine_keys.data_address().unwrap(),
            prompt.data_address().unwrap()
        );
        assert_eq!(&rows_of(engine_keys)[..100], &rows_of(&prompt)[..100]);
    }

    #[test]
    fn rewinding() {
        let mut standard = LayerCache::standard();
        standard.update(&keys(0, 10), &keys(0, 10), None).unwrap();
        standard.rewind(4).unwrap();
        let (k, _, _) = standard.update(&keys(4, 1), &keys(4, 1), None).unwrap();
        assert_eq!(rows_of(&k), vec![0., 1., 2., 3., 4.]);
        let mut ring = LayerCache::rotating(4);
        ring.update(&keys(0, 6), &keys(0, 6), None).unwrap();
        // Holds positions 2..6: the token at 5 needs 2..5, the token at 4 would need 1..4.
        assert!(ring.can_rewind(5) && !ring.can_rewind(4));
        ring.rewind(5).unwrap();
        let (k, _, _) = ring.update(&keys(5, 1), &keys(5, 1), None).unwrap();
        assert_eq!(rows_of(&k), vec![2., 3., 4., 5.]);
        assert!(ring.rewind(1).is_err());
    }

    #[test]
    fn every_kind_says_how_far_it_can_rewind() {
        // A latent cache keeps every position: any prefix can be reused.
        let mut latent = LayerCache::latent();
        let (l, pe, mask) = latent.update_latent(&keys(0, 6), &keys(0, 6)).unwrap();
        assert_eq!(rows_of(&l), rows_of(&pe));
        assert!(matches!(mask, Mask::Causal));
        assert_eq!(latent.rewind_floor(), 0);
        latent.rewind(2).unwrap();
        let (l, _, _) = latent.update_latent(&keys(2, 1), &keys(2, 1)).unwrap();
        assert_eq!(rows_of(&l), vec![0., 1., 2.]);
        // ...and refuses to be used as a key/value cache.
        assert!(latent.update(&keys(3, 1), &keys(3, 1), None).is_err());
        // A recurrent state can only stay where it is.
        let mut state = LayerCache::state();
        if let LayerCache::State(s) = &mut state {
            s.arrays = vec![Some(keys(0, 4))];
            s.advance(4);
        }
        assert_eq!(state.rewind_floor(), 4);
        assert!(state.can_rewind(4) && !state.can_rewind(3));
        assert!(state.rewind(2).is_err());
        assert_eq!(state.nbytes(), 16);
        assert!(state.update(&keys(4, 1), &keys(4, 1), None).is_err());
        // A shared cache holds nothing and follows its source's position.
        let mut shared = LayerCache::shared(0);
        shared.follow(5);
        assert_eq!((shared.offset(), shared.nbytes()), (5, 0));
        shared.rewind(3).unwrap();
        assert_eq!(shared.offset(), 3);
        // A ring's floor is the first position whose whole window it still holds.
        let mut ring = LayerCache::rotating(4);
        ring.update(&keys(0, 10), &keys(0, 10), None).unwrap();
        assert_eq!(ring.rewind_floor(), 6 + 4 - 1);
    }

    #[test]
    fn standard_cache_grows_and_masks() {
        let mut cache = LayerCache::standard();
        let (k, _, mask) = cache.update(&keys(0, 5), &keys(0, 5), None).unwrap();
        assert_eq!(rows_of(&k), vec![0., 1., 2., 3., 4.]);
        assert!(matches!(mask, Mask::Causal));
        let (k, _, mask) = cache.update(&keys(5, 1), &keys(5, 1), None).unwrap();
        assert_eq!(k.dim(2).unwrap(), 6);
        assert!(matches!(mask, Mask::None));
        // Windowed layer in a standard cache: only the visible rows come back.
        let (k, _, mask) = cache.update(&keys(6, 1), &keys(6, 1), Some(3)).unwrap();
        assert_eq!(rows_of(&k), vec![4., 5., 6.]);
        assert!(matches!(mask, Mask::None));
        for p in 7..300 {
            cache.update(&keys(p, 1), &keys(p, 1), None).unwrap();
        }
        assert_eq!(cache.offset(), 300);
    }
}

/// The same layer's keys and values of several conversations in one buffer `[B, H, cap, D]`,
/// for decoding them as one batch: row `b`'s cached positions fill columns `pads[b]..len`
/// (left padding aligns every row's newest position to one column), so a decode step writes
/// all rows with one update and attends with one masked kernel, whatever their lengths. Made
/// from the conversations' own caches by [`BatchCache::merge`] and given back by
/// [`BatchCache::split`]. A sliding-window layer keeps every row while batched and masks to its
/// window (its ring is rebuilt on the split).
#[derive(Debug, Clone)]
pub struct BatchCache {
    keys: Array,
    values: Array,
    pads: Vec<usize>,
    len: usize,
    /// Each row's position count (the position its next token takes).
    positions: Vec<usize>,
    /// The ring width of a sliding-window layer's caches.
    ring: Option<usize>,
    /// Shared by the layers of one batch (see [`BatchCache::share_step_inputs`]).
    step_inputs: StepInputs,
}

/// The row positions and padding masks of a decode batch's current step. Every layer derives
/// the same ones from the same pads and length, so the layers of one batch share them: one
/// host-built array per step instead of one per layer, which on a GPU is one upload instead of
/// dozens.
/// A cloned cache gets a set of its own (a clone may go on with other rows or steps).
#[derive(Default)]
struct StepInputs(std::sync::Arc<std::sync::Mutex<StepArrays>>);

impl Clone for StepInputs {
    fn clone(&self) -> StepInputs {
        StepInputs::default()
    }
}

impl std::fmt::Debug for StepInputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepInputs")
    }
}

#[derive(Default)]
struct StepArrays {
    /// The batch length these arrays were built for (a new step starts a new set).
    len: usize,
    positions: Option<Array>,
    /// Padding masks by the first visible column.
    masks: Vec<(usize, Array)>,
}

impl StepInputs {
    /// The array cached for step `len` under `pick`, else `build`'s, cached.
    fn get_or_build(
        &self,
        len: usize,
        pick: impl Fn(&mut StepArrays) -> Option<&mut Array>,
        store: impl FnOnce(&mut StepArrays, Array),
        build: impl FnOnce() -> Result<Array>,
    ) -> Result<Array> {
        let mut arrays = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if arrays.len != len {
            *arrays = StepArrays {
                len,
                ..StepArrays::default()
            };
        }
        if let Some(a) = pick(&mut arrays) {
            return Ok(a.clone());
        }
        let a = build()?;
        store(&mut arrays, a.clone());
        Ok(a)
    }
}

/// A cache's held keys and values in temporal order `[1, H, S, D]`, the positions processed,
/// and the ring width of a sliding-window cache.
fn held_rows(cache: &LayerCache) -> Result<(Array, Array, usize, Option<usize>)> {
    match cache {
        LayerCache::Standard(c) => match (&c.keys, &c.values) {
            (Some(k), Some(v)) if c.offset > 0 => Ok((
                k.slice_axis(2, 0, c.offset as i32)?,
                v.slice_axis(2, 0, c.offset as i32)?,
                c.offset,
                None,
            )),
            _ => Err(crate::ModelError::Runtime(
                "internal: an empty cache cannot join a decode batch".into(),
            )),
        },
        LayerCache::Rotating(c) => match (&c.keys, &c.values) {
            (Some(k), Some(v)) => Ok((c.ordered(k)?, c.ordered(v)?, c.offset, Some(c.window))),
            _ => Err(crate::ModelError::Runtime(
                "internal: an empty cache cannot join a decode batch".into(),
            )),
        },
        other => Err(other.wrong_kind("batched key/value attention")),
    }
}

impl BatchCache {
    /// One layer's caches of several conversations (standard, or sliding-window rings of one
    /// width, none empty) as one batch.
    pub fn merge(rows: &[&LayerCache]) -> Result<BatchCache> {
        let held: Vec<_> = rows.iter().map(|c| held_rows(c)).collect::<Result<_>>()?;
        let ring = held.first().and_then(|h| h.3);
        if held.iter().any(|h| h.3 != ring) {
            return Err(crate::ModelError::Runtime(
                "internal: a decode batch mixes caches of different windows".into(),
            ));
        }
        let len = held
            .iter()
            .map(|h| h.0.dim(2))
            .collect::<mlxcel_core::Result<Vec<_>>>()?;
        let len = len.into_iter().max().unwrap_or(0) as usize;
        // Room for the coming steps, so most steps write in place.
        let cap = (len as i32 + 1 + STEP - 1) / STEP * STEP;
        let mut pads = Vec::with_capacity(rows.len());
        let padded = |a: &Array, before: usize| -> Result<Array> {
            let mut parts = Vec::new();
            let mut shape = a.shape();
            if before > 0 {
                shape[2] = before as i32;
                parts.push(ops::zeros(&shape, a.dtype()?)?);
            }
            parts.push(a.clone());
            shape[2] = cap - len as i32;
            parts.push(ops::zeros(&shape, a.dtype()?)?);
            Ok(ops::concatenate(&parts, 2)?)
        };
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for (k, v, _, _) in &held {
            let pad = len - k.dim(2)? as usize;
            pads.push(pad);
            ks.push(padded(k, pad)?);
            vs.push(padded(v, pad)?);
        }
        Ok(BatchCache {
            keys: ops::concatenate(&ks, 0)?,
            values: ops::concatenate(&vs, 0)?,
            pads,
            len,
            positions: held.iter().map(|h| h.2).collect(),
            ring,
            step_inputs: StepInputs::default(),
        })
    }

    /// Makes every layer of `caches` (one batch's, all [`LayerCache::Batch`]) share one set of
    /// per-step positions and masks: they are equal across layers, so each step builds them
    /// once.
    pub fn share_step_inputs(caches: &mut [LayerCache]) {
        let shared = StepInputs::default();
        for c in caches {
            if let LayerCache::Batch(b) = c {
                b.step_inputs = StepInputs(shared.0.clone());
            }
        }
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.pads.len()
    }

    /// Each row's next position `[B]` (int32), for the rotary embedding.
    pub fn positions(&self) -> Result<Array> {
        // Before this layer's update (rope comes first), so the step is `len + 1`.
        self.step_inputs.get_or_build(
            self.len + 1,
            |a| a.positions.as_mut(),
            |a, p| a.positions = Some(p),
            || {
                let p: Vec<i32> = self.positions.iter().map(|p| *p as i32).collect();
                Ok(Array::from_slice(&p, &[p.len() as i32])?)
            },
        )
    }

    /// Appends one position per row (`k` `[B, H, 1, D]`); returns the keys and values a query
    /// of this step sees and their mask `[B, 1, 1, S]` (row padding, and the window).
    fn update(
        &mut self,
        k: &Array,
        v: &Array,
        window: Option<usize>,
    ) -> Result<(Array, Array, Mask)> {
        if k.dim(2)? != 1 || k.dim(0)? as usize != self.rows() {
            return Err(crate::ModelError::Runtime(format!(
                "internal: a decode batch of {} rows takes one position per row, not {:?}",
                self.rows(),
                k.shape()
            )));
        }
        if self.len + 1 > self.keys.dim(2)? as usize {
            // Full (`len` never exceeds the buffer): STEP more rows, shaped like the buffer.
            let cap = self.len + STEP as usize;
            self.keys = grow_rows(Some(&self.keys), self.len, cap, &self.keys)?;
            self.values = grow_rows(Some(&self.values), self.len, cap, &self.values)?;
        }
        self.keys = write_rows(&self.keys, k, self.len)?;
        self.values = write_rows(&self.values, v, self.len)?;
        self.len += 1;
        for p in &mut self.positions {
            *p += 1;
        }
        let first = match window {
            Some(w) => self.len.saturating_sub(w),
            None => self.pads.iter().copied().min().unwrap_or(0),
        };
        let (s, e) = (first as i32, self.len as i32);
        let keys = self.keys.slice_axis(2, s, e)?;
        let values = self.values.slice_axis(2, s, e)?;
        if self.pads.iter().all(|p| *p <= first) {
            return Ok((keys, values, Mask::None));
        }
        let (len, rows, pads) = (self.len, self.rows(), &self.pads);
        let mask = self.step_inputs.get_or_build(
            len,
            |a| {
                a.masks
                    .iter_mut()
                    .find(|(f, _)| *f == first)
                    .map(|(_, m)| m)
            },
            |a, m| a.masks.push((first, m)),
            || {
                let keep: Vec<bool> = pads
                    .iter()
                    .flat_map(|pad| (first..len).map(move |col| col >= *pad))
                    .collect();
                Ok(Array::from_slice(
                    &keep,
                    &[rows as i32, 1, 1, (len - first) as i32],
                )?)
            },
        )?;
        Ok((keys, values, Mask::Array(mask)))
    }

    /// Each row's cache again, as it would be had the row decoded alone.
    pub fn split(&self) -> Result<Vec<LayerCache>> {
        let mut out = Vec::with_capacity(self.rows());
        for (b, (&pad, &offset)) in self.pads.iter().zip(&self.positions).enumerate() {
            let held = self.len - pad;
            let first = match self.ring {
                Some(w) => self.len - held.min(w),
                None => pad,
            };
            let row = |a: &Array| -> Result<Array> {
                Ok(a.slice_axis(0, b as i32, b as i32 + 1)?.slice_axis(
                    2,
                    first as i32,
                    self.len as i32,
                )?)
            };
            let (k, v) = (row(&self.keys)?, row(&self.values)?);
            out.push(match self.ring {
                None => LayerCache::Standard(StandardCache {
                    keys: Some(k),
                    values: Some(v),
                    offset,
                    blocks: Vec::new(),
                    owner: None,
                    prompt_rows: false,
                }),
                Some(window) => LayerCache::Rotating(RotatingCache {
                    window,
                    keys: Some(k),
                    values: Some(v),
                    start: 0,
                    offset,
                    blocks: Vec::new(),
                }),
            });
        }
        Ok(out)
    }
}

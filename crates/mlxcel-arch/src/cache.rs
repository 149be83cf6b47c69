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
    /// Boolean `[L, S]`, true = attend.
    Array(Array),
    /// Additive float, broadcastable to `[B, H, L, S]`: 0 where attended, a large finite
    /// negative where hidden (finite, so a query row that sees no key stays finite).
    Additive(Array),
}

impl Mask {
    /// The boolean mask for queries at absolute positions `q0..q0+l` over keys at `k0..k0+s`,
    /// causal and limited to `window` keys per query.
    pub fn window(q0: usize, l: usize, k0: usize, s: usize, window: Option<usize>) -> Result<Mask> {
        let keep: Vec<bool> = (0..l * s)
            .map(|f| {
                let (qp, kp) = (q0 + f / s, k0 + f % s);
                kp <= qp && window.is_none_or(|w| qp - kp < w)
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
    /// One bidirectional pass (see [`LayerCache::bidirectional`]).
    Bidirectional(BidirectionalCache),
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
        })
    }

    /// Positions processed so far.
    pub fn offset(&self) -> usize {
        match self {
            LayerCache::Standard(c) | LayerCache::Latent(c) => c.offset,
            LayerCache::Rotating(c) => c.offset,
            LayerCache::State(c) => c.offset,
            LayerCache::Shared { offset, .. } => *offset,
            LayerCache::Bidirectional(c) => c.offset,
        }
    }

    fn kind_name(&self) -> &'static str {
        match self {
            LayerCache::Standard(_) => "standard KV",
            LayerCache::Rotating(_) => "rotating KV",
            LayerCache::Latent(_) => "latent KV",
            LayerCache::State(_) => "state",
            LayerCache::Shared { .. } => "shared",
            LayerCache::Bidirectional(_) => "bidirectional",
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
            LayerCache::Bidirectional(c) => c.offset,
        }
    }

    /// Whether the cache can be cut back to its first `position` tokens (see
    /// [`LayerCache::rewind_floor`]).
    pub fn can_rewind(&self, position: usize) -> bool {
        self.rewind_floor() <= position && position <= self.offset()
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
            LayerCache::State(_) | LayerCache::Bidirectional(_) => {}
            LayerCache::Shared { offset, .. } => *offset = position,
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

    /// Bytes held by the cache buffers.
    pub fn nbytes(&self) -> usize {
        let planes: Vec<&Option<Array>> = match self {
            LayerCache::Standard(c) | LayerCache::Latent(c) => vec![&c.keys, &c.values],
            LayerCache::Rotating(c) => vec![&c.keys, &c.values],
            LayerCache::State(c) => c.arrays.iter().collect(),
            LayerCache::Shared { .. } | LayerCache::Bidirectional(_) => vec![],
        };
        planes.into_iter().flatten().map(Array::nbytes).sum()
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
        if end > rows(&self.keys)? {
            let shape = k.shape();
            let cap = (end as i32 + STEP - 1) / STEP * STEP;
            let grow = |old: &Option<Array>, new: &Array| -> Result<Array> {
                let mut s = shape.clone();
                s[2] = cap - prev as i32;
                s[3] = new.dim(3)?;
                let fresh = ops::zeros(&s, new.dtype()?)?;
                Ok(match old {
                    Some(o) => ops::concatenate(&[o.slice_axis(2, 0, prev as i32)?, fresh], 2)?,
                    None => fresh,
                })
            };
            self.keys = Some(grow(&self.keys, k)?);
            self.values = Some(grow(&self.values, v)?);
        }
        let write = |buf: &Array, new: &Array| -> Result<Array> {
            let mut start = vec![0; 4];
            start[2] = prev as i32;
            let mut stop = buf.shape();
            stop[2] = end as i32;
            Ok(buf.slice_update(new, &start, &stop, &[1, 1, 1, 1])?)
        };
        let keys = write(self.keys.as_ref().expect("grown above"), k)?;
        let values = write(self.values.as_ref().expect("grown above"), v)?;
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
        let mask = if l == 1 && window.is_none_or(|w| end - first <= w) {
            Mask::None
        } else if window.is_none() {
            Mask::Causal
        } else {
            Mask::window(prev, l, first, end - first, window)?
        };
        Ok((k_out, v_out, mask))
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
            let write = |buf: &Array, new: &Array| -> Result<Array> {
                let mut stop = buf.shape();
                stop[2] = self.start as i32 + 1;
                Ok(buf.slice_update(new, &[0, 0, self.start as i32, 0], &stop, &[1, 1, 1, 1])?)
            };
            let keys = write(self.keys.as_ref().expect("held == window > 0"), k)?;
            let values = write(self.values.as_ref().expect("held == window > 0"), v)?;
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
        let mask = Mask::window(self.offset, l, self.offset - keep, total, Some(w))?;
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

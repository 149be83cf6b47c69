//! The runtime side: per MoE layer a slot arena of fixed capacity (one MLX array per plane,
//! `[slots, ..plane]`), a cache policy deciding which expert leaves a slot, and bounded
//! parallel `pread`s of missing experts from the layer's stream file.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use mlxcel_core::{ops, Array, Dtype};
use xxhash_rust::xxh3::xxh3_64;

use crate::io::{self, read_threads};
use crate::manifest::{parse_hash, LayerEntry};
use crate::{Result, StreamError};

/// Which resident expert gives up its slot on a miss (defined with the runtime policy).
pub use mlxcel_core::policy::CachePolicy;
/// How expert bytes are read from disk (defined with the runtime policy).
pub use mlxcel_core::policy::ExpertIo;

/// Counters shared by every layer of a model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamStats {
    /// Experts requested that were already resident.
    pub hits: u64,
    /// Experts requested that had to be read from disk.
    pub misses: u64,
    /// Bytes read from stream files (the experts' bytes; a direct read's alignment padding is
    /// not counted).
    pub bytes_read: u64,
    /// Wall-clock seconds spent in those reads (parallel reads counted once; a read ahead
    /// counts its own duration, so reads overlapping each other make
    /// [`StreamStats::read_gb_per_second`] a lower bound).
    pub read_seconds: f64,
    /// Seconds the computation waited for expert reads (its own, or ones started ahead and not
    /// finished yet): what streaming costs a step beyond the arithmetic.
    pub wait_seconds: f64,
    /// Experts read ahead of their layer's turn (predicted by the previous streamed layer).
    pub prefetched: u64,
    /// Of those, the experts their layer then needed (the rest were read for nothing).
    pub prefetch_used: u64,
    /// How expert bytes were read: the mode asked for, or `dontneed` after the file system
    /// refused `O_DIRECT`. `None` before any layer was opened.
    pub io: Option<ExpertIo>,
    /// Of the experts each token selected, how many the previous token of the same layer had
    /// selected too (summed over tokens that had a previous one).
    pub reused: u64,
    /// Selections of tokens that had a previous token in their layer: the denominator of
    /// [`StreamStats::reuse_rate`].
    pub reuse_base: u64,
    /// Per streamed layer (in the order they were opened), how often each expert was selected.
    pub selections: Vec<Vec<u64>>,
}

impl StreamStats {
    /// `hits / (hits + misses)`, 0 before any request.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }

    /// Read bandwidth while reading, in GB/s (10^9 bytes); 0 before any read.
    pub fn read_gb_per_second(&self) -> f64 {
        if self.read_seconds > 0.0 {
            self.bytes_read as f64 / self.read_seconds / 1e9
        } else {
            0.0
        }
    }

    /// The fraction of a token's selected experts that the previous token in the same layer
    /// had also selected: what an arena holding just the last token's experts would hit.
    pub fn reuse_rate(&self) -> f64 {
        self.reused as f64 / self.reuse_base.max(1) as f64
    }

    /// The share of selections taken by the most popular tenth of a layer's experts (at least
    /// one), averaged over layers: 0.1 for perfectly uniform routing, towards 1 for a few
    /// experts taking everything. 0 before any selection.
    pub fn top_decile_share(&self) -> f64 {
        let shares: Vec<f64> = self
            .selections
            .iter()
            .filter_map(|counts| {
                let total: u64 = counts.iter().sum();
                if total == 0 {
                    return None;
                }
                let mut sorted = counts.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                let top = counts.len().div_ceil(10).max(1);
                Some(sorted[..top].iter().sum::<u64>() as f64 / total as f64)
            })
            .collect();
        if shares.is_empty() {
            0.0
        } else {
            shares.iter().sum::<f64>() / shares.len() as f64
        }
    }

    /// The share of experts read ahead that their layer then needed; 0 before any.
    pub fn prefetch_accuracy(&self) -> f64 {
        self.prefetch_used as f64 / self.prefetched.max(1) as f64
    }

    /// The one-line summary the CLI prints after a run.
    pub fn describe(&self) -> String {
        format!(
            "[experts: {} hits, {} misses ({:.1}% hit rate), {:.1} MiB read in {:.2}s ({:.2} GB/s, io {}), waited {:.2}s; {} read ahead ({:.1}% then needed); routing: {:.1}% reuse between consecutive tokens, top-10% experts take {:.1}% of selections]",
            self.hits,
            self.misses,
            100.0 * self.hit_rate(),
            self.bytes_read as f64 / (1 << 20) as f64,
            self.read_seconds,
            self.read_gb_per_second(),
            self.io.map_or("-", ExpertIo::name),
            self.wait_seconds,
            self.prefetched,
            100.0 * self.prefetch_accuracy(),
            100.0 * self.reuse_rate(),
            100.0 * self.top_decile_share(),
        )
    }
}

/// Which expert sits in which slot, and which to evict.
#[derive(Debug, Clone)]
pub struct SlotMap {
    policy: CachePolicy,
    slot_of: HashMap<usize, usize>,
    occupant: Vec<Option<usize>>,
    last_use: Vec<u64>,
    uses: HashMap<usize, u64>,
    clock: u64,
}

impl SlotMap {
    /// `capacity` empty slots, evicting by `policy`.
    ///
    /// ```
    /// use mlxcel_stream::{CachePolicy, SlotMap};
    ///
    /// let mut slots = SlotMap::new(2, CachePolicy::from_name("lru").unwrap());
    /// // Experts 7 and 3 fill the two free slots: both must be loaded.
    /// let (placed, loads) = slots.plan(&[7, 3]);
    /// assert_eq!(loads, vec![(7, placed[0]), (3, placed[1])]);
    /// // 7 is resident: a hit, nothing to load.
    /// assert_eq!(slots.plan(&[7]), (vec![placed[0]], vec![]));
    /// // 5 evicts 3, the least recently used.
    /// assert_eq!(slots.plan(&[5]), (vec![placed[1]], vec![(5, placed[1])]));
    /// ```
    pub fn new(capacity: usize, policy: CachePolicy) -> SlotMap {
        SlotMap {
            policy,
            slot_of: HashMap::new(),
            occupant: vec![None; capacity],
            last_use: vec![0; capacity],
            uses: HashMap::new(),
            clock: 0,
        }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.occupant.len()
    }

    /// Whether `expert` sits in a slot.
    pub fn holds(&self, expert: usize) -> bool {
        self.slot_of.contains_key(&expert)
    }

    /// Empties `slots`: their experts were planned in but never arrived (a failed read), so
    /// the next request for them must load them again.
    pub fn forget(&mut self, slots: &[usize]) {
        for &s in slots {
            if let Some(e) = self.occupant.get_mut(s).and_then(Option::take) {
                self.slot_of.remove(&e);
            }
        }
    }

    /// Slots for `needed` (distinct experts, at most `capacity`): the slot of each, and the
    /// (expert, slot) pairs that must be loaded. Victims never hold an expert of `needed`.
    pub fn plan(&mut self, needed: &[usize]) -> (Vec<usize>, Vec<(usize, usize)>) {
        debug_assert!(needed.len() <= self.capacity());
        self.clock += 1;
        let mut slots = Vec::with_capacity(needed.len());
        let mut loads = Vec::new();
        let mut pinned = vec![false; self.capacity()];
        for e in needed {
            if let Some(&s) = self.slot_of.get(e) {
                pinned[s] = true;
            }
        }
        for &e in needed {
            *self.uses.entry(e).or_default() += 1;
            let slot = match self.slot_of.get(&e) {
                Some(&s) => s,
                None => {
                    let victim = (0..self.capacity())
                        .filter(|s| !pinned[*s])
                        .min_by_key(|s| match self.occupant[*s] {
                            None => (0, 0, 0),
                            Some(o) => match self.policy {
                                CachePolicy::Lru => (1, self.last_use[*s], 0),
                                CachePolicy::Lfu => (
                                    1,
                                    self.uses.get(&o).copied().unwrap_or(0),
                                    self.last_use[*s],
                                ),
                            },
                        })
                        .expect("needed.len() <= capacity leaves a free slot");
                    if let Some(old) = self.occupant[victim].take() {
                        self.slot_of.remove(&old);
                    }
                    self.occupant[victim] = Some(e);
                    self.slot_of.insert(e, victim);
                    pinned[victim] = true;
                    loads.push((e, victim));
                    victim
                }
            };
            self.last_use[slot] = self.clock;
            slots.push(slot);
        }
        (slots, loads)
    }
}

/// Whether each expert read from disk is checked against its xxh3 in the manifest
/// (`MLXCEL_EXPERT_VERIFY` of the installed [`mlxcel_core::policy`]; off only to measure what
/// the check costs).
fn verify_reads() -> bool {
    mlxcel_core::policy::with(|p| p.expert_verify)
}

/// Reads experts from one layer's stream file; shared with the background thread of a read
/// ahead ([`LayerStream::prefetch`]).
struct Reader {
    path: PathBuf,
    /// The layer's prefix, for errors.
    prefix: String,
    /// Opened normally: `pread`s of `dontneed` and `cached`, and the fallback of `direct`.
    file: File,
    /// Opened with `O_DIRECT` when reads are `direct`; `None` once the file system refused.
    direct: Option<File>,
    /// How reads go (`direct` becomes `dontneed` on a refusal, in a new reader).
    io: ExpertIo,
    /// Per expert the xxh3-64 its bytes must have; `None` when reads are not checked.
    hashes: Option<Vec<u64>>,
    /// Bytes from one expert's start to the next's.
    stride: u64,
    /// Bytes read per expert.
    len: usize,
    /// Finished reads ahead not yet in the stats; shared with the buffered reader that
    /// replaces this one after an `O_DIRECT` refusal, so a read ahead still running on this
    /// reader is counted all the same.
    ahead: Arc<AheadTally>,
}

/// Bytes and nanoseconds of finished reads ahead, not yet added to the stats (a read ahead
/// nobody waits for finishes on its own; the layer's next fetch counts it).
#[derive(Default)]
struct AheadTally {
    bytes: AtomicU64,
    nanos: AtomicU64,
}

/// Reads of predicted experts running on a background thread.
struct ReadAhead {
    experts: Vec<usize>,
    reads: JoinHandle<AheadResult>,
}

/// What a [`ReadAhead`] thread returns: the blobs in `experts` order, and whether the file
/// system refused `O_DIRECT` on the way.
struct AheadResult {
    blobs: Result<Vec<Blob>>,
    refused: bool,
}

/// One MoE layer's streamed experts.
pub struct LayerStream {
    entry: LayerEntry,
    reader: Arc<Reader>,
    /// Where this layer's selection counts sit in `stats.selections`.
    stats_index: usize,
    /// The experts the previous token of this layer selected (sorted), for the reuse rate.
    previous: Vec<u32>,
    /// Experts being read ahead of this layer's next call, if any.
    ahead: Option<ReadAhead>,
    slots: SlotMap,
    /// One array per plane, `[capacity, ..plane shape]`, in manifest order.
    arena: Vec<Array>,
    float_dtype: Dtype,
    /// Misses are copied straight into their slots where the arena's buffers allow it
    /// ([`LayerStream::write_in_place`]).
    in_place: bool,
    stats: Rc<RefCell<StreamStats>>,
}

impl std::fmt::Debug for LayerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The arena arrays, hashes and file handle say little; name the layer and its sizes.
        f.debug_struct("LayerStream")
            .field("path", &self.reader.path)
            .field("experts", &self.entry.experts)
            .field("capacity", &self.capacity())
            .field("io", &self.reader.io)
            .field("float_dtype", &self.float_dtype)
            .finish_non_exhaustive()
    }
}

/// The dtype a plane is held in: its file dtype, or `float_dtype` for float planes.
fn held_dtype(stored: &str, float_dtype: Dtype) -> Dtype {
    match Dtype::from_name(stored) {
        Some(d) if d.is_float() => float_dtype,
        Some(d) => d,
        None => Dtype::Uint8,
    }
}

impl LayerStream {
    /// Opens a layer's stream with `capacity` slots, read as `io` says. Float planes (dense
    /// expert weights, affine scales and biases) are held in `float_dtype`, the model's compute
    /// dtype.
    pub fn open(
        dir: &Path,
        entry: &LayerEntry,
        capacity: usize,
        policy: CachePolicy,
        io: ExpertIo,
        float_dtype: Dtype,
        stats: Rc<RefCell<StreamStats>>,
    ) -> Result<LayerStream> {
        let path = dir.join(&entry.file);
        let file = File::open(&path).map_err(|e| StreamError::io(&path, e))?;
        let (direct, io) = match io {
            ExpertIo::Direct => match io::try_open_direct(&path) {
                Ok(f) => (Some(f), ExpertIo::Direct),
                Err(e) if io::refuses_direct(&e) => {
                    direct_refused(&path);
                    (None, ExpertIo::Dontneed)
                }
                Err(e) => return Err(StreamError::io(&path, e)),
            },
            other => (None, other),
        };
        if io == ExpertIo::Dontneed {
            io::no_readahead(&file);
        }
        let hashes = entry
            .expert_xxh3
            .iter()
            .map(|h| parse_hash(h))
            .collect::<Option<Vec<u64>>>()
            .filter(|h| h.len() == entry.experts)
            .ok_or_else(|| StreamError::Layout {
                path: path.clone(),
                message: format!(
                    "layer `{}`: the manifest has no valid per-expert hashes",
                    entry.prefix
                ),
            })?;
        let arena = entry
            .planes
            .iter()
            .map(|p| {
                let dtype = held_dtype(&p.dtype, float_dtype);
                let mut shape = vec![capacity as i32];
                shape.extend(&p.shape);
                Ok(ops::zeros(&shape, dtype)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let stats_index = {
            let mut s = stats.borrow_mut();
            s.io = Some(io);
            s.selections.push(vec![0; entry.experts]);
            s.selections.len() - 1
        };
        Ok(LayerStream {
            entry: entry.clone(),
            reader: Arc::new(Reader {
                path,
                prefix: entry.prefix.clone(),
                file,
                direct,
                io,
                hashes: verify_reads().then_some(hashes),
                stride: entry.expert_stride,
                len: entry.read_len() as usize,
                ahead: Arc::default(),
            }),
            stats_index,
            previous: Vec::new(),
            ahead: None,
            slots: SlotMap::new(capacity, policy),
            arena,
            float_dtype,
            in_place: true,
            stats,
        })
    }

    /// Whether misses are copied straight into their slots (default): a host `memcpy` on the
    /// CPU backend, one CUDA driver copy on MLX's CUDA backend, where the arena's buffer is held
    /// by nothing else; `false` writes every slot through MLX's `slice_update` (to measure
    /// the gain; the bytes are the same).
    pub fn write_in_place(&mut self, on: bool) {
        self.in_place = on;
    }

    /// Number of arena slots (experts resident at once).
    pub fn capacity(&self) -> usize {
        self.slots.capacity()
    }

    /// The layer's manifest entry.
    pub fn entry(&self) -> &LayerEntry {
        &self.entry
    }

    /// The arena of a plane (`gate_proj.weight`, ...), or `None` if the layer has no such plane.
    pub fn plane(&self, name: &str) -> Option<&Array> {
        self.entry
            .planes
            .iter()
            .position(|p| p.name == name)
            .map(|i| &self.arena[i])
    }

    /// Records the router's choices for the routing statistics: `chosen` is `[tokens, k]`
    /// row-major, tokens in sequence order (the reuse rate compares each with the one before,
    /// across calls).
    pub fn observe(&mut self, chosen: &[u32], k: usize) {
        if k == 0 {
            return;
        }
        let mut stats = self.stats.borrow_mut();
        let stats = &mut *stats;
        let counts = &mut stats.selections[self.stats_index];
        for token in chosen.chunks(k) {
            for &e in token {
                if let Some(c) = counts.get_mut(e as usize) {
                    *c += 1;
                }
            }
            let mut now = token.to_vec();
            now.sort_unstable();
            now.dedup();
            if !self.previous.is_empty() {
                stats.reused += now
                    .iter()
                    .filter(|e| self.previous.binary_search(e).is_ok())
                    .count() as u64;
                stats.reuse_base += now.len() as u64;
            }
            self.previous = now;
        }
    }

    /// How this layer reads now: the mode asked for, or `dontneed` after a refused `O_DIRECT`.
    pub fn io(&self) -> ExpertIo {
        self.reader.io
    }

    /// Starts reading, on a background thread, those of `experts` (a prediction of what this
    /// layer's next call needs; at most `capacity` are taken) that are not resident. The next
    /// [`LayerStream::fetch`] takes the blobs it needs from these reads, waiting for them if
    /// they have not finished, and drops the rest. Does nothing while earlier reads ahead are
    /// unclaimed, or when no thread can be started (the experts are then read on demand).
    pub fn prefetch(&mut self, experts: &[usize]) {
        if self.ahead.is_some() {
            return;
        }
        let mut wanted: Vec<usize> = experts
            .iter()
            .copied()
            .filter(|e| *e < self.entry.experts && !self.slots.holds(*e))
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        wanted.truncate(self.capacity());
        if wanted.is_empty() {
            return;
        }
        let reader = Arc::clone(&self.reader);
        let threads = read_threads();
        let list = wanted.clone();
        let spawned = std::thread::Builder::new()
            .name("mlxcel-expert-read-ahead".into())
            .spawn(move || {
                let started = Instant::now();
                let refused = AtomicBool::new(false);
                let blobs = reader.read(&list, threads, &refused);
                if let Ok(b) = &blobs {
                    reader
                        .ahead
                        .bytes
                        .fetch_add(total_len(b), Ordering::Relaxed);
                    let nanos = started.elapsed().as_nanos() as u64;
                    reader.ahead.nanos.fetch_add(nanos, Ordering::Relaxed);
                }
                AheadResult {
                    blobs,
                    refused: refused.load(Ordering::Relaxed),
                }
            });
        if let Ok(reads) = spawned {
            self.stats.borrow_mut().prefetched += wanted.len() as u64;
            self.ahead = Some(ReadAhead {
                experts: wanted,
                reads,
            });
        }
    }

    /// Makes `experts` (distinct, at most `capacity`) resident; returns the slot of each.
    /// Missing experts are read with bounded parallel `pread`s and written into free or evicted
    /// slots. Callers evaluate everything that read a slot before the next call can evict it.
    pub fn ensure(&mut self, experts: &[usize]) -> Result<Vec<usize>> {
        let fetched = self.fetch(experts)?;
        self.install(fetched)
    }

    /// The first half of [`LayerStream::ensure`]: picks the slots of `experts` and reads the
    /// missing ones from disk, without touching the arena, so the reads can overlap the
    /// computation of a previous wave that still reads slots these will replace. Hand the
    /// result to [`LayerStream::install`] once that computation is evaluated, or to
    /// [`LayerStream::abandon`].
    pub fn fetch(&mut self, experts: &[usize]) -> Result<Fetched> {
        if experts.len() > self.capacity() {
            return Err(StreamError::Layout {
                path: self.reader.path.clone(),
                message: format!(
                    "{} experts needed at once but the arena has {} slots",
                    experts.len(),
                    self.capacity()
                ),
            });
        }
        if let Some(bad) = experts.iter().find(|e| **e >= self.entry.experts) {
            return Err(StreamError::Layout {
                path: self.reader.path.clone(),
                message: format!("expert {bad} out of range ({} experts)", self.entry.experts),
            });
        }
        let (slots, loads) = self.slots.plan(experts);
        {
            let mut stats = self.stats.borrow_mut();
            stats.misses += loads.len() as u64;
            stats.hits += (experts.len() - loads.len()) as u64;
        }
        // Reads ahead none of `loads` needs are left to finish on their own (a wait would only
        // delay this call); the ones it needs are waited for once its own reads are done.
        let ahead = self
            .ahead
            .take()
            .filter(|a| loads.iter().any(|(e, _)| a.experts.contains(e)));
        if loads.is_empty() {
            self.count_reads_ahead();
            return Ok(Fetched {
                slots,
                loads,
                blobs: Vec::new(),
            });
        }
        let started = Instant::now();
        let refused = AtomicBool::new(false);
        let threads = read_threads();
        // What is not being read ahead is read now, while the reads ahead go on.
        let ahead_has = |e: &usize| ahead.as_ref().is_some_and(|a| a.experts.contains(e));
        let now: Vec<usize> = loads
            .iter()
            .map(|(e, _)| *e)
            .filter(|e| !ahead_has(e))
            .collect();
        let read_now = self.reader.read(&now, threads, &refused);
        let mut own_read_seconds = started.elapsed().as_secs_f64();
        let mut blob_of: HashMap<usize, Blob> = HashMap::new();
        let mut late = Vec::new();
        if let Some(a) = ahead {
            let result = a.reads.join().unwrap_or_else(|_| AheadResult {
                blobs: Err(StreamError::Config(
                    "an expert read-ahead thread panicked".into(),
                )),
                refused: false,
            });
            if result.refused {
                refused.store(true, Ordering::Relaxed);
            }
            let needed = |e: &usize| loads.iter().any(|(l, _)| l == e);
            match result.blobs {
                Ok(blobs) => {
                    for (e, b) in a.experts.into_iter().zip(blobs) {
                        if needed(&e) {
                            blob_of.insert(e, b);
                        }
                    }
                    self.stats.borrow_mut().prefetch_used += blob_of.len() as u64;
                }
                // A failed read ahead costs nothing but time: what is needed of it is read
                // again below, and that read reports the error if it persists.
                Err(_) => late.extend(a.experts.into_iter().filter(needed)),
            }
        }
        let mut bytes = 0u64;
        let read_late = read_now.and_then(|blobs| {
            bytes += total_len(&blobs);
            blob_of.extend(now.into_iter().zip(blobs));
            let late_started = Instant::now();
            let blobs = self.reader.read(&late, threads, &refused)?;
            own_read_seconds += late_started.elapsed().as_secs_f64();
            bytes += total_len(&blobs);
            blob_of.extend(late.into_iter().zip(blobs));
            Ok(())
        });
        let blobs = match read_late {
            Ok(()) => loads
                .iter()
                .map(|(e, _)| blob_of.remove(e).expect("every load was read"))
                .collect::<Vec<Blob>>(),
            Err(e) => {
                // Those slots lost their old experts and never got the new ones.
                self.forget_loads(&loads);
                return Err(e);
            }
        };
        self.count_reads_ahead();
        if refused.load(Ordering::Relaxed) && self.reader.direct.is_some() {
            // The open succeeded but the reads were refused: read this layer as `dontneed`
            // from now on (the blobs above were already re-read that way).
            self.reader = Arc::new(self.reader.buffered()?);
            self.stats.borrow_mut().io = Some(ExpertIo::Dontneed);
        }
        let mut stats = self.stats.borrow_mut();
        stats.bytes_read += bytes;
        stats.read_seconds += own_read_seconds;
        stats.wait_seconds += started.elapsed().as_secs_f64();
        Ok(Fetched {
            slots,
            loads,
            blobs,
        })
    }

    /// Adds the finished reads ahead's bytes and time to the stats.
    fn count_reads_ahead(&self) {
        let bytes = self.reader.ahead.bytes.swap(0, Ordering::Relaxed);
        let nanos = self.reader.ahead.nanos.swap(0, Ordering::Relaxed);
        let mut stats = self.stats.borrow_mut();
        stats.bytes_read += bytes;
        stats.read_seconds += nanos as f64 * 1e-9;
    }

    /// The second half of [`LayerStream::ensure`]: writes the experts `fetched` read into their
    /// slots; returns the slot of each expert asked for.
    pub fn install(&mut self, fetched: Fetched) -> Result<Vec<usize>> {
        let Fetched {
            slots,
            loads,
            blobs,
        } = fetched;
        for (k, ((_, slot), blob)) in loads.iter().zip(&blobs).enumerate() {
            if let Err(e) = self.write_slot(*slot, blob.bytes()) {
                // This slot and the ones not yet written hold other bytes than the map says.
                self.forget_loads(&loads[k..]);
                return Err(e);
            }
        }
        Ok(slots)
    }

    /// Copies one expert's bytes into `slot` of every plane's arena: in place where the plane
    /// is held as stored and its buffer is the arena's alone (a host `memcpy` on the CPU
    /// backend, a driver copy into device memory on CUDA), else through
    /// MLX (`slice_update`, converting float planes to the compute dtype).
    fn write_slot(&mut self, slot: usize, blob: &[u8]) -> Result<()> {
        let in_place = self.in_place;
        for (i, plane) in self.entry.planes.iter().enumerate() {
            let bytes = &blob[plane.offset as usize..(plane.offset + plane.nbytes) as usize];
            let stored = Dtype::from_name(&plane.dtype).unwrap_or(Dtype::Uint8);
            if in_place
                && held_dtype(&plane.dtype, self.float_dtype) == stored
                && self.arena[i].write_bytes_in_place(slot * bytes.len(), bytes)?
            {
                continue;
            }
            let mut shape = vec![1];
            shape.extend(&plane.shape);
            let mut update = Array::from_bytes(bytes, &shape, stored)?;
            let held = held_dtype(&plane.dtype, self.float_dtype);
            if held != stored {
                update = update.astype(held)?;
            }
            let mut start = vec![0; shape.len()];
            start[0] = slot as i32;
            let mut stop = self.arena[i].shape();
            stop[0] = slot as i32 + 1;
            self.arena[i] =
                self.arena[i].slice_update(&update, &start, &stop, &vec![1; shape.len()])?;
        }
        Ok(())
    }

    /// Drops a [`Fetched`] that will not be installed (the computation it waited for failed):
    /// its slots are emptied, so the slot map never claims an expert the arena does not hold.
    pub fn abandon(&mut self, fetched: Fetched) {
        self.forget_loads(&fetched.loads);
    }

    /// Empties the slots of `(expert, slot)` loads that did not reach the arena.
    fn forget_loads(&mut self, loads: &[(usize, usize)]) {
        let lost: Vec<usize> = loads.iter().map(|(_, s)| *s).collect();
        self.slots.forget(&lost);
    }
}

impl Reader {
    /// Reads the blobs of `experts` concurrently, at most `threads` at a time, each checked
    /// against its expert's hash in the manifest before it can reach a slot. A direct read the
    /// file system refuses is redone as `dontneed` and flags `refused`.
    fn read(&self, experts: &[usize], threads: usize, refused: &AtomicBool) -> Result<Vec<Blob>> {
        let (stride, len) = (self.stride, self.len);
        let mut out: Vec<Blob> = (0..experts.len()).map(|_| Blob::empty(len)).collect();
        let hashes = self.hashes.as_deref();
        let (path, prefix, file) = (&self.path, &self.prefix, &self.file);
        let (direct, mode) = (self.direct.as_ref(), self.io);
        io::parallel(path, experts, &mut out, threads, |expert, blob| {
            let offset = *expert as u64 * stride;
            let mut buffered = mode;
            if let Some(direct) = direct {
                match io::read_direct_span(direct, path, offset, len, &mut blob.buf) {
                    Ok(skip) => blob.skip = skip,
                    Err(e) if io::error_refuses_direct(&e) => {
                        if !refused.swap(true, Ordering::Relaxed) {
                            direct_refused(path);
                        }
                        buffered = ExpertIo::Dontneed;
                    }
                    Err(e) => return Err(e),
                }
            }
            if buffered != ExpertIo::Direct {
                blob.buf.resize(len);
                blob.skip = 0;
                io::read_exact_at(file, path, offset, blob.buf.as_mut_slice())?;
                if buffered == ExpertIo::Dontneed {
                    io::drop_cached(file, offset, len);
                }
            }
            if let Some(want) = hashes.and_then(|h| h.get(*expert)) {
                let got = xxh3_64(blob.bytes());
                if got != *want {
                    return Err(corrupt(path, prefix, *expert, got, *want));
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// This reader without `O_DIRECT`: `dontneed` reads, readahead off (after a refusal).
    fn buffered(&self) -> Result<Reader> {
        let file = self
            .file
            .try_clone()
            .map_err(|e| StreamError::io(&self.path, e))?;
        io::no_readahead(&file);
        Ok(Reader {
            path: self.path.clone(),
            prefix: self.prefix.clone(),
            file,
            direct: None,
            io: ExpertIo::Dontneed,
            hashes: self.hashes.clone(),
            stride: self.stride,
            len: self.len,
            ahead: Arc::clone(&self.ahead),
        })
    }
}

/// Experts read by [`LayerStream::fetch`], waiting for [`LayerStream::install`].
pub struct Fetched {
    /// The slot of each expert asked for.
    slots: Vec<usize>,
    /// `(expert, slot)` of each expert read.
    loads: Vec<(usize, usize)>,
    /// Their bytes, in `loads` order.
    blobs: Vec<Blob>,
}

impl std::fmt::Debug for Fetched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetched")
            .field("slots", &self.slots)
            .field("loads", &self.loads)
            .finish_non_exhaustive()
    }
}

/// One expert's bytes as read: `len` bytes from `skip` in `buf` (a direct read's buffer holds
/// the aligned blocks around them).
struct Blob {
    buf: io::AlignedBuf,
    skip: usize,
    len: usize,
}

impl Blob {
    fn empty(len: usize) -> Blob {
        Blob {
            buf: io::AlignedBuf::zeroed(0),
            skip: 0,
            len,
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[self.skip..self.skip + self.len]
    }
}

/// The experts' bytes in `blobs` (a direct read's alignment padding not counted).
fn total_len(blobs: &[Blob]) -> u64 {
    blobs.iter().map(|b| b.len as u64).sum()
}

/// Says once per process that `O_DIRECT` was refused and reads fall back to `dontneed`: the
/// run goes on (the bytes are the same), but its read figures are no longer direct reads.
fn direct_refused(path: &Path) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!(
            "[experts: {}: the file system refuses O_DIRECT reads; MLXCEL_EXPERT_IO=direct falls back to dontneed]",
            path.display()
        );
    }
}

/// The error for an expert whose bytes read from disk do not hash to the manifest's value.
fn corrupt(path: &Path, prefix: &str, expert: usize, got: u64, want: u64) -> StreamError {
    StreamError::Layout {
        path: path.to_path_buf(),
        message: format!(
            "expert {expert} of layer `{prefix}` read from disk has xxh3 {got:016x}, the manifest says {want:016x}: the stream file is corrupt or was changed; rerun `mlxcel prepare-expert-stream`"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_and_lfu_evict_differently() {
        // Capacity 2: use expert 0 often, then 1, then 2 arrives.
        let mut lru = SlotMap::new(2, CachePolicy::Lru);
        let mut lfu = SlotMap::new(2, CachePolicy::Lfu);
        for m in [&mut lru, &mut lfu] {
            m.plan(&[0]);
            m.plan(&[0]);
            m.plan(&[0]);
            m.plan(&[1]);
        }
        // LRU evicts 0 (least recent); LFU evicts 1 (least frequent).
        let (_, loads) = lru.plan(&[2]);
        assert_eq!(loads.len(), 1);
        assert_eq!(lru.plan(&[1]).1.len(), 0, "LRU kept 1");
        let (_, loads) = lfu.plan(&[2]);
        assert_eq!(loads.len(), 1);
        assert_eq!(lfu.plan(&[0]).1.len(), 0, "LFU kept 0");
    }

    #[test]
    fn routing_statistics() {
        let mut s = StreamStats {
            selections: vec![vec![0; 20], vec![5; 20]],
            ..Default::default()
        };
        // Layer 0: experts 0 and 1 (the top 10% of 20) take 30 of 40 selections.
        s.selections[0][0] = 20;
        s.selections[0][1] = 10;
        s.selections[0][7] = 10;
        // Layer 1 is uniform: its top two take 10%.
        assert!((s.top_decile_share() - (0.75 + 0.1) / 2.0).abs() < 1e-12);
        assert_eq!(StreamStats::default().top_decile_share(), 0.0);
        s.bytes_read = 3_000_000_000;
        s.read_seconds = 2.0;
        assert!((s.read_gb_per_second() - 1.5).abs() < 1e-12);
        s.reused = 3;
        s.reuse_base = 12;
        assert!((s.reuse_rate() - 0.25).abs() < 1e-12);
        let line = s.describe();
        assert!(
            line.contains("1.50 GB/s") && line.contains("25.0% reuse"),
            "{line}"
        );
    }

    #[test]
    fn needed_experts_are_never_victims() {
        let mut m = SlotMap::new(3, CachePolicy::Lru);
        m.plan(&[0, 1, 2]);
        let (slots, loads) = m.plan(&[2, 3, 0]);
        assert_eq!(loads.len(), 1);
        assert_eq!(loads[0].0, 3);
        // 3 took 1's slot, the only one not needed.
        let (slots0, _) = m.plan(&[0, 2, 3]);
        assert_eq!(slots0, vec![slots[2], slots[0], slots[1]]);
    }
}

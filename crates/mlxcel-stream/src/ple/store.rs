//! The runtime side: rows read on demand (`mmap`, `direct` or `ram`), an LRU cache of row
//! records, gather-ahead of the next prefill chunk on a background thread, and dequantization
//! to the compute dtype with MLX's own `dequantize`.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use mlxcel_core::ops::{self, QuantMode, QuantSpec};
use mlxcel_core::policy::PleIo;
use mlxcel_core::{Array, Dtype};

use super::layout::{PleLayout, RowFormat};
use crate::io::{self, AlignedBuf};
use crate::{Result, StreamError};

/// Counters of one table, read after a run (the stats line).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PleStats {
    /// Rows served without a disk read: from the cache, a repeat inside one pass, or (in `ram`
    /// mode) the table in memory.
    pub hits: u64,
    /// Rows read from disk (in the foreground or gathered ahead).
    pub misses: u64,
    /// Of the misses, rows read ahead while the previous chunk computed.
    pub gathered_ahead: u64,
    /// Bytes read from the row files (in `ram` mode: the table, at load).
    pub bytes_read: u64,
    /// Seconds spent reading (gather-ahead reads included, though they overlap compute).
    pub read_seconds: f64,
}

impl PleStats {
    /// `hits / (hits + misses)`, 0 before any request.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }

    /// The stats line printed after a generation.
    pub fn describe(&self) -> String {
        format!(
            "[PLE rows: {} hits, {} misses ({:.1}% hit rate, {} gathered ahead), {:.2} MiB read in {:.3} s]",
            self.hits,
            self.misses,
            100.0 * self.hit_rate(),
            self.gathered_ahead,
            self.bytes_read as f64 / (1u64 << 20) as f64,
            self.read_seconds
        )
    }
}

/// The row files as the I/O mode opens them.
enum Backing {
    /// Read-only shared mappings (with the file, to notice a truncation before touching pages).
    Mmap(Vec<(File, memmap2::Mmap)>),
    /// Files opened for `O_DIRECT` reads.
    Direct(Vec<File>),
    /// Per shard, per extent: the extent's rows, read at load.
    Ram(Vec<Vec<Vec<u8>>>),
}

/// The thread-safe reading half: what the gather-ahead thread shares with the model's thread.
struct RowSource {
    layout: PleLayout,
    backing: Backing,
}

impl RowSource {
    fn open(layout: PleLayout, mode: PleIo) -> Result<(RowSource, u64, f64)> {
        let started = Instant::now();
        let mut loaded = 0u64;
        let backing = match mode {
            PleIo::Mmap => Backing::Mmap(
                layout
                    .files
                    .iter()
                    .map(|p| {
                        let file = File::open(p).map_err(|e| StreamError::io(p, e))?;
                        // SAFETY: read-only mapping; reads go through `copy_row`, which first
                        // checks that the file still covers the range (a file truncated
                        // concurrently with the copy can still fault: `direct` cannot).
                        let map = unsafe { memmap2::Mmap::map(&file) }
                            .map_err(|e| StreamError::io(p, e))?;
                        Ok((file, map))
                    })
                    .collect::<Result<_>>()?,
            ),
            PleIo::Direct => Backing::Direct(
                layout
                    .files
                    .iter()
                    .map(|p| io::open_direct(p))
                    .collect::<Result<_>>()?,
            ),
            PleIo::Ram => {
                let files = layout
                    .files
                    .iter()
                    .map(|p| File::open(p).map_err(|e| StreamError::io(p, e)))
                    .collect::<Result<Vec<_>>>()?;
                let mut shards = Vec::new();
                for shard in &layout.shards {
                    let mut planes = Vec::new();
                    for e in &shard.extents {
                        let mut buf = vec![0u8; (e.stride * shard.row_count) as usize];
                        let path = &layout.files[e.file];
                        io::read_exact_at(&files[e.file], path, e.offset, &mut buf)?;
                        loaded += buf.len() as u64;
                        planes.push(buf);
                    }
                    shards.push(planes);
                }
                Backing::Ram(shards)
            }
        };
        Ok((
            RowSource { layout, backing },
            loaded,
            started.elapsed().as_secs_f64(),
        ))
    }

    /// Bytes a disk read of one row costs.
    fn row_bytes(&self) -> u64 {
        self.layout.record_bytes as u64
    }

    /// Copies row `id`'s record (its planes back to back) into `out`.
    fn read_row(&self, id: u64, out: &mut [u8], scratch: &mut AlignedBuf) -> Result<()> {
        let layout = &self.layout;
        let s = layout
            .shards
            .partition_point(|s| s.row_start + s.row_count <= id);
        let shard = &layout.shards[s];
        let local = id - shard.row_start;
        let mut at = 0usize;
        for (k, e) in shard.extents.iter().enumerate() {
            let len = e.len as usize;
            let dst = &mut out[at..at + len];
            let offset = e.offset + local * e.stride;
            let path = &layout.files[e.file];
            match &self.backing {
                Backing::Mmap(maps) => {
                    let (file, map) = &maps[e.file];
                    let end = offset + len as u64;
                    // A file shortened since it was mapped would fault on the copy: check first.
                    let size = file
                        .metadata()
                        .map_err(|err| StreamError::io(path, err))?
                        .len();
                    if size < end || (map.len() as u64) < end {
                        return Err(StreamError::io(
                            path,
                            std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                format!(
                                    "file is truncated: {len} bytes expected at offset {offset}, {} found",
                                    size.min(map.len() as u64).saturating_sub(offset)
                                ),
                            ),
                        ));
                    }
                    dst.copy_from_slice(&map[offset as usize..end as usize]);
                }
                Backing::Direct(files) => {
                    io::read_direct(&files[e.file], path, offset, dst, scratch)?;
                }
                Backing::Ram(shards) => {
                    let plane = &shards[s][k];
                    let start = (local * e.stride) as usize;
                    dst.copy_from_slice(&plane[start..start + len]);
                }
            }
            at += len;
        }
        Ok(())
    }

    /// Reads the records of `ids` with bounded parallel reads.
    fn read_rows(&self, ids: &[u64]) -> Result<Vec<Vec<u8>>> {
        let record = self.layout.record_bytes;
        let mut out: Vec<Vec<u8>> = vec![Vec::new(); ids.len()];
        let threads = match self.backing {
            Backing::Ram(_) => 1,
            _ => io::read_threads(),
        };
        io::parallel(
            &self.layout.manifest_path,
            ids,
            &mut out,
            threads,
            |id, buf| {
                *buf = vec![0u8; record];
                let mut scratch = AlignedBuf::zeroed(0);
                self.read_row(*id, buf, &mut scratch)
            },
        )?;
        Ok(out)
    }
}

/// An LRU cache of row records, bounded in rows.
#[derive(Debug, Default)]
struct RowCache {
    capacity: usize,
    rows: HashMap<u64, (Rc<[u8]>, u64)>,
    by_age: BTreeMap<u64, u64>,
    clock: u64,
}

impl RowCache {
    fn new(capacity: usize) -> RowCache {
        RowCache {
            capacity,
            ..RowCache::default()
        }
    }

    fn get(&mut self, id: u64) -> Option<Rc<[u8]>> {
        let (row, age) = self.rows.get_mut(&id)?;
        self.by_age.remove(age);
        self.clock += 1;
        *age = self.clock;
        self.by_age.insert(self.clock, id);
        Some(row.clone())
    }

    fn insert(&mut self, id: u64, row: Rc<[u8]>) {
        if self.capacity == 0 {
            return;
        }
        self.clock += 1;
        if let Some((_, old)) = self.rows.insert(id, (row, self.clock)) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, id);
        while self.rows.len() > self.capacity {
            let (_, victim) = self.by_age.pop_first().expect("non-empty");
            self.rows.remove(&victim);
        }
    }
}

/// A read-ahead in flight: the ids asked for and the thread reading them.
type Gathered = Result<(Vec<(u64, Vec<u8>)>, f64)>;

/// An external per-layer-embedding table: rows on disk, read per pass.
pub struct PleStore {
    source: Arc<RowSource>,
    io: PleIo,
    cache: RefCell<RowCache>,
    /// Rows read ahead and not yet used.
    staged: RefCell<HashMap<u64, Rc<[u8]>>>,
    pending: RefCell<Option<JoinHandle<Gathered>>>,
    stats: Rc<RefCell<PleStats>>,
}

impl std::fmt::Debug for PleStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PleStore")
            .field("manifest", &self.source.layout.manifest_path)
            .field("rows", &self.source.layout.row_count)
            .field("row_width", &self.source.layout.row_width)
            .field("format", &self.source.layout.format)
            .field("io", &self.io)
            .field("cache_rows", &self.cache.borrow().capacity)
            .finish_non_exhaustive()
    }
}

impl PleStore {
    /// Opens the table of `layout` for reads in mode `io` with a row cache of `cache_bytes`
    /// (rounded down to whole rows; none in `ram` mode, where every row is in memory).
    pub fn open(layout: PleLayout, io: PleIo, cache_bytes: u64) -> Result<PleStore> {
        let record = layout.record_bytes.max(1) as u64;
        let capacity = if io == PleIo::Ram {
            0
        } else {
            (cache_bytes / record).min(layout.row_count) as usize
        };
        let (source, loaded, seconds) = RowSource::open(layout, io)?;
        let stats = PleStats {
            bytes_read: loaded,
            read_seconds: seconds,
            ..PleStats::default()
        };
        Ok(PleStore {
            source: Arc::new(source),
            io,
            cache: RefCell::new(RowCache::new(capacity)),
            staged: RefCell::new(HashMap::new()),
            pending: RefCell::new(None),
            stats: Rc::new(RefCell::new(stats)),
        })
    }

    /// The checked manifest.
    pub fn layout(&self) -> &PleLayout {
        &self.source.layout
    }

    /// The I/O mode.
    pub fn io(&self) -> PleIo {
        self.io
    }

    /// Rows the cache holds at most.
    pub fn cache_rows(&self) -> usize {
        self.cache.borrow().capacity
    }

    /// Bytes this table holds in memory: the cache's capacity, or the whole table in `ram`
    /// mode (what `inspect` and `--estimate-memory` count instead of the table on disk).
    pub fn resident_bytes(&self) -> u64 {
        match self.io {
            PleIo::Ram => self.source.layout.table_bytes(),
            _ => self.cache_rows() as u64 * self.source.row_bytes(),
        }
    }

    /// The counters (shared: the caller keeps a handle to print them after a run).
    pub fn stats(&self) -> Rc<RefCell<PleStats>> {
        self.stats.clone()
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let rows = self.source.layout.row_count;
        if let Some(bad) = ids.iter().find(|id| u64::from(**id) >= rows) {
            return Err(StreamError::Layout {
                path: self.source.layout.manifest_path.clone(),
                message: format!("row {bad} asked for, the table has {rows} rows"),
            });
        }
        Ok(())
    }

    /// Takes in what a finished (or unfinished: waits) read-ahead gathered.
    fn collect_pending(&self) -> Result<()> {
        let Some(handle) = self.pending.borrow_mut().take() else {
            return Ok(());
        };
        let (rows, seconds) = handle.join().unwrap_or_else(|_| {
            Err(StreamError::io(
                &self.source.layout.manifest_path,
                std::io::Error::other("PLE gather-ahead thread panicked"),
            ))
        })?;
        let mut stats = self.stats.borrow_mut();
        stats.read_seconds += seconds;
        stats.bytes_read += rows.len() as u64 * self.source.row_bytes();
        let mut staged = self.staged.borrow_mut();
        for (id, row) in rows {
            staged.insert(id, Rc::from(row));
        }
        Ok(())
    }

    /// Starts reading, on a background thread, the rows of `next_ids` (the next prefill chunk)
    /// that the cache does not hold, so that they are ready when [`PleStore::rows`] asks for
    /// them. Ids out of range are left for `rows` to refuse.
    pub fn prefetch(&self, next_ids: &[u32]) -> Result<()> {
        if self.io == PleIo::Ram {
            return Ok(());
        }
        self.collect_pending()?;
        // Rows gathered for a pass that is over and did not use them: keep them as cached rows
        // rather than staged ones, so staging holds one chunk at most.
        {
            let mut cache = self.cache.borrow_mut();
            for (id, row) in self.staged.borrow_mut().drain() {
                cache.insert(id, row);
            }
        }
        let rows = self.source.layout.row_count;
        let mut wanted: Vec<u64> = Vec::new();
        {
            let cache = self.cache.borrow();
            let mut seen = HashSet::new();
            for id in next_ids.iter().map(|i| u64::from(*i)) {
                if id < rows && !cache.rows.contains_key(&id) && seen.insert(id) {
                    wanted.push(id);
                }
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        let source = self.source.clone();
        let handle = std::thread::Builder::new()
            .name("mlxcel-ple-gather".into())
            .spawn(move || -> Gathered {
                let started = Instant::now();
                let rows = source.read_rows(&wanted)?;
                Ok((
                    wanted.into_iter().zip(rows).collect(),
                    started.elapsed().as_secs_f64(),
                ))
            })
            .map_err(|e| StreamError::io(&self.source.layout.manifest_path, e))?;
        *self.pending.borrow_mut() = Some(handle);
        Ok(())
    }

    /// The raw records of `ids`, in order (repeats included), from the cache, the rows gathered
    /// ahead, or disk.
    fn records(&self, ids: &[u32]) -> Result<Vec<Rc<[u8]>>> {
        self.check_ids(ids)?;
        self.collect_pending()?;
        let mut found: HashMap<u64, Rc<[u8]>> = HashMap::new();
        let mut missing: Vec<u64> = Vec::new();
        // Ids seen in this pass (a repeat is a hit whichever way its first use was served).
        let mut pending_ids: HashSet<u64> = HashSet::new();
        let (mut hits, mut ahead) = (0u64, 0u64);
        {
            let mut cache = self.cache.borrow_mut();
            let mut staged = self.staged.borrow_mut();
            for id in ids.iter().map(|i| u64::from(*i)) {
                if found.contains_key(&id) || !pending_ids.insert(id) {
                    hits += 1;
                } else if self.io == PleIo::Ram {
                    missing.push(id);
                } else if let Some(row) = cache.get(id) {
                    hits += 1;
                    found.insert(id, row);
                } else if let Some(row) = staged.remove(&id) {
                    ahead += 1;
                    cache.insert(id, row.clone());
                    found.insert(id, row);
                } else {
                    missing.push(id);
                }
            }
        }
        let started = Instant::now();
        let read = self.source.read_rows(&missing)?;
        {
            let mut stats = self.stats.borrow_mut();
            if self.io == PleIo::Ram {
                stats.hits += hits + missing.len() as u64;
            } else {
                let seconds = started.elapsed().as_secs_f64();
                stats.hits += hits;
                stats.misses += ahead + missing.len() as u64;
                stats.gathered_ahead += ahead;
                stats.bytes_read += missing.len() as u64 * self.source.row_bytes();
                stats.read_seconds += seconds;
            }
        }
        let mut cache = self.cache.borrow_mut();
        for (id, row) in missing.into_iter().zip(read) {
            let row: Rc<[u8]> = Rc::from(row);
            cache.insert(id, row.clone());
            found.insert(id, row);
        }
        Ok(ids.iter().map(|i| found[&u64::from(*i)].clone()).collect())
    }

    /// The stored records of `ids` (planes back to back), for checks.
    pub(crate) fn raw_records(&self, ids: &[u32]) -> Result<Vec<Rc<[u8]>>> {
        self.records(ids)
    }

    /// The rows of `ids` as a `[ids.len(), row_width]` array in `dtype`: unquantized rows cast
    /// as the resident load casts its tables, quantized rows through MLX's `dequantize` (scales
    /// and biases cast to `dtype` first, as a resident quantized table holds them).
    pub fn rows(&self, ids: &[u32], dtype: Dtype) -> Result<Array> {
        let records = self.records(ids)?;
        rows_array(
            self.source.layout.format,
            self.source.layout.row_width,
            &records,
            dtype,
        )
    }
}

/// What a table in mode `io` with a cache of `cache_bytes` holds in memory.
pub fn resident_bytes(layout: &PleLayout, io: PleIo, cache_bytes: u64) -> u64 {
    match io {
        PleIo::Ram => layout.table_bytes(),
        _ => {
            let record = layout.record_bytes.max(1) as u64;
            (cache_bytes / record).min(layout.row_count) * record
        }
    }
}

/// Assembles row records (planes back to back) into per-plane arrays and dequantizes them.
pub(crate) fn rows_array(
    format: RowFormat,
    width: usize,
    records: &[impl AsRef<[u8]>],
    dtype: Dtype,
) -> Result<Array> {
    let n = records.len();
    let planes = format.planes();
    let mut arrays = Vec::with_capacity(planes.len());
    let mut at = 0usize;
    for (name, _, pdtype) in &planes {
        let elems = format.plane_elems(name, width);
        let len = elems * pdtype.size_of();
        let mut bytes = Vec::with_capacity(n * len);
        for r in records {
            bytes.extend_from_slice(&r.as_ref()[at..at + len]);
        }
        at += len;
        arrays.push(Array::from_bytes(
            &bytes,
            &[n as i32, elems as i32],
            *pdtype,
        )?);
    }
    let cast = |a: &Array| -> Result<Array> { Ok(a.astype(dtype)?) };
    Ok(match format {
        RowFormat::Plain(stored) if stored == dtype => arrays.remove(0),
        RowFormat::Plain(_) => cast(&arrays[0])?,
        RowFormat::Affine4 | RowFormat::Affine4Float(_) => ops::dequantize(
            &arrays[0],
            &cast(&arrays[1])?,
            Some(&cast(&arrays[2])?),
            QuantSpec::affine(32, 4),
            Some(dtype),
        )?,
        RowFormat::Nvfp4 => ops::dequantize(
            &arrays[0],
            &arrays[1],
            None,
            QuantSpec::fixed(QuantMode::Nvfp4).expect("nvfp4 is a fixed layout"),
            Some(dtype),
        )?,
    })
}

//! The disk side shared by expert streaming and external per-layer-embedding rows: exact
//! positioned reads (a short file is an error naming it, never a fault), `O_DIRECT` reads into
//! aligned buffers, bounded parallel reads on scoped threads, and SHA-256 of files.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::{Result, StreamError};

/// Alignment of `O_DIRECT` reads: offsets, lengths and buffer addresses are multiples of it
/// (the logical block size of every common file system divides 4096).
pub const DIRECT_ALIGN: usize = 4096;

/// How many reads run at once (`MLXCEL_EXPERT_READ_THREADS` of the installed
/// [`mlxcel_core::policy`], default 4): expert blobs and PLE rows share the setting.
pub fn read_threads() -> usize {
    mlxcel_core::policy::with(|p| p.expert_read_threads).max(1)
}

/// The error for a read that found fewer bytes than the layout promised.
fn truncated(path: &Path, offset: u64, want: usize, got: usize) -> StreamError {
    StreamError::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("file is truncated: {want} bytes expected at offset {offset}, {got} found"),
        ),
    )
}

/// Fills `buf` from `offset` of `file` with `pread`s; end of file first is an error saying the
/// file is truncated.
pub fn read_exact_at(file: &File, path: &Path, offset: u64, buf: &mut [u8]) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => return Err(truncated(path, offset, buf.len(), done)),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(StreamError::io(path, e)),
        }
    }
    Ok(())
}

/// A heap buffer whose start is [`DIRECT_ALIGN`]-aligned, as `O_DIRECT` requires.
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` zeroed bytes.
    pub fn zeroed(len: usize) -> AlignedBuf {
        let storage = vec![0u8; len + DIRECT_ALIGN];
        let start = storage.as_ptr().align_offset(DIRECT_ALIGN);
        AlignedBuf {
            storage,
            start,
            len,
        }
    }

    /// Makes it `len` bytes long, reallocating (zeroed) when it cannot hold them; bytes kept
    /// are not cleared (every user overwrites what it reads).
    pub fn resize(&mut self, len: usize) {
        if self.capacity() < len {
            *self = AlignedBuf::zeroed(len);
        }
        self.len = len;
    }

    /// Bytes it can hold without reallocating.
    pub fn capacity(&self) -> usize {
        self.storage.len() - self.start
    }

    /// The start address modulo [`DIRECT_ALIGN`] (0: what `O_DIRECT` needs).
    #[cfg(test)]
    fn as_ptr_aligned(&self) -> usize {
        self.as_slice().as_ptr() as usize % DIRECT_ALIGN
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Opens `path` for reads that bypass the page cache: `O_DIRECT` on Linux, `F_NOCACHE` on
/// macOS. A file system that refuses direct I/O is an error naming the file.
pub fn open_direct(path: &Path) -> Result<File> {
    try_open_direct(path).map_err(|e| {
        let hint = if refuses_direct(&e) {
            std::io::Error::new(
                e.kind(),
                "the file system does not support O_DIRECT reads (MLXCEL_PLE_IO=direct); use mmap or ram",
            )
        } else {
            e
        };
        StreamError::io(path, hint)
    })
}

/// [`open_direct`] with the OS error as it came, so that a caller with a fallback can tell a
/// file system that refuses direct I/O ([`refuses_direct`]) from a missing file.
pub fn try_open_direct(path: &Path) -> std::io::Result<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let file = File::open(path)?;
        #[cfg(target_os = "macos")]
        {
            use std::os::unix::io::AsRawFd;
            // SAFETY: fcntl on a descriptor this function owns; F_NOCACHE takes an int flag.
            unsafe {
                libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1);
            }
        }
        Ok(file)
    }
}

/// Whether `e` is a file system refusing `O_DIRECT` (tmpfs and some FUSE and network file
/// systems answer `EINVAL`, at `open` or at the first read).
pub fn refuses_direct(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Whether a [`StreamError`] from [`read_direct_span`] is a file system refusing `O_DIRECT`.
pub fn error_refuses_direct(e: &StreamError) -> bool {
    matches!(e, StreamError::Io { source, .. } if refuses_direct(source))
}

/// Turns off the kernel's readahead for `file` (`POSIX_FADV_RANDOM`): with `dontneed` reads,
/// pages read ahead past a range would stay cached after the range itself is dropped (measured:
/// 635 of 864 MiB of stream files left in the page cache after one run). Advice only, as
/// [`drop_cached`].
pub fn no_readahead(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: advice on a descriptor `file` keeps open for the call; no memory is passed.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
    }
}

/// Drops `len` bytes at `offset` of `file` (0: to the end), widened to whole pages, from the
/// page cache (`POSIX_FADV_DONTNEED`): after a read whose bytes were copied elsewhere, so a
/// streamed model does not fill memory with cached expert files. Advice only: a failure is
/// ignored (the read itself succeeded), and it does nothing where `posix_fadvise` does not exist.
pub fn drop_cached(file: &File, offset: u64, len: usize) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::io::AsRawFd;
        // The kernel drops only whole pages inside the range: widen it to page boundaries, or
        // the partial last page of every read stays cached (`len` 0 means "to the end").
        // SAFETY: sysconf has no preconditions.
        let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(1) as u64;
        let start = offset / page * page;
        let span = if len == 0 {
            0
        } else {
            (offset + len as u64).div_ceil(page) * page - start
        };
        // SAFETY: advice on a descriptor `file` keeps open for the call; no memory is passed.
        unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                start as libc::off_t,
                span as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, offset, len);
    }
}

/// Reads `out.len()` bytes at `offset` of a file opened with [`open_direct`]: the aligned
/// blocks covering the range go into `scratch` (grown as needed), the range is copied out. A file
/// that ends before the range does is an error saying it is truncated.
pub fn read_direct(
    file: &File,
    path: &Path,
    offset: u64,
    out: &mut [u8],
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let skip = read_direct_span(file, path, offset, out.len(), scratch)?;
    out.copy_from_slice(&scratch.as_slice()[skip..skip + out.len()]);
    Ok(())
}

/// Reads the [`DIRECT_ALIGN`]-aligned blocks covering `len` bytes at `offset` of a file opened
/// with [`open_direct`] into `buf` (reallocated when too small: `O_DIRECT` wants aligned
/// offsets, lengths and addresses, which an arbitrary tensor range is not); returns where the
/// range starts in `buf`. A file that ends before the range does is an error saying it is
/// truncated; a file system refusing direct reads is an `Io` error with `EINVAL`
/// ([`error_refuses_direct`]).
pub fn read_direct_span(
    file: &File,
    path: &Path,
    offset: u64,
    len: usize,
    buf: &mut AlignedBuf,
) -> Result<usize> {
    let align = DIRECT_ALIGN as u64;
    let first = offset / align * align;
    let end = offset + len as u64;
    let last = end.div_ceil(align) * align;
    let span = (last - first) as usize;
    buf.resize(span);
    let bytes = &mut buf.storage[buf.start..buf.start + span];
    let mut done = 0usize;
    // O_DIRECT reads return whole blocks; the last one may be short at end of file.
    while done < span {
        match file.read_at(&mut bytes[done..], first + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(StreamError::io(path, e)),
        }
    }
    let need = (end - first) as usize;
    let skip = (offset - first) as usize;
    if done < need {
        return Err(truncated(path, offset, len, done.saturating_sub(skip)));
    }
    Ok(skip)
}

/// Runs `work` over `jobs` on at most `threads` scoped threads (contiguous runs of jobs per
/// thread), each thread owning the matching run of `outputs`. The first error wins; a panicking
/// thread is an error naming `path`.
pub fn parallel<J: Sync, O: Send>(
    path: &Path,
    jobs: &[J],
    outputs: &mut [O],
    threads: usize,
    work: impl Fn(&J, &mut O) -> Result<()> + Sync,
) -> Result<()> {
    debug_assert_eq!(jobs.len(), outputs.len());
    if jobs.is_empty() {
        return Ok(());
    }
    let threads = threads.min(jobs.len()).max(1);
    if threads == 1 {
        for (job, out) in jobs.iter().zip(outputs.iter_mut()) {
            work(job, out)?;
        }
        return Ok(());
    }
    let per_thread = jobs.len().div_ceil(threads);
    let work = &work;
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = outputs
            .chunks_mut(per_thread)
            .zip(jobs.chunks(per_thread))
            .map(|(outs, jobs)| {
                scope.spawn(move || -> Result<()> {
                    for (job, out) in jobs.iter().zip(outs.iter_mut()) {
                        work(job, out)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(StreamError::io(
                        path,
                        std::io::Error::other("read thread panicked"),
                    ))
                })
            })
            .collect()
    });
    results.into_iter().collect()
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 (hex) of a whole file, read in 1 MiB pieces.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| StreamError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| StreamError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_reads_any_range_and_refuse_a_short_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = open_direct(&path).unwrap();
        let mut scratch = AlignedBuf::zeroed(0);
        for (off, len) in [
            (0usize, 1usize),
            (4095, 2),
            (5000, 5000),
            (9999, 1),
            (123, 4096),
        ] {
            let mut out = vec![0u8; len];
            read_direct(&file, &path, off as u64, &mut out, &mut scratch).unwrap();
            assert_eq!(out, &data[off..off + len], "{off}+{len}");
        }
        let mut out = vec![0u8; 10];
        let err = read_direct(&file, &path, 9995, &mut out, &mut scratch).unwrap_err();
        assert!(
            err.to_string()
                .contains("file is truncated: 10 bytes expected at offset 9995, 5 found"),
            "{err}"
        );
        let plain = File::open(&path).unwrap();
        let err = read_exact_at(&plain, &path, 9995, &mut out).unwrap_err();
        assert!(
            err.to_string()
                .contains("file is truncated: 10 bytes expected at offset 9995, 5 found"),
            "{err}"
        );
    }

    /// The bounce-buffer read at unaligned offsets and lengths (in one block, across block
    /// boundaries, up to the end of the file, with a buffer reused across sizes) gives the bytes
    /// an ordinary read gives.
    #[test]
    fn direct_spans_match_ordinary_reads_at_unaligned_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.bin");
        let size = 5 * DIRECT_ALIGN + 777;
        let data: Vec<u8> = (0..size as u64)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        let direct = match try_open_direct(&path) {
            Ok(f) => f,
            Err(e) if refuses_direct(&e) => {
                eprintln!("skip: the temporary folder refuses O_DIRECT");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let plain = File::open(&path).unwrap();
        let mut buf = AlignedBuf::zeroed(0);
        let a = DIRECT_ALIGN;
        for (off, len) in [
            (1, 1),
            (a - 1, 2),
            (a, a),
            (a + 3, 3 * a - 5),
            (17, size - 17),
            (size - 1, 1),
            (2 * a + 100, 10),
            (0, size),
        ] {
            let skip = read_direct_span(&direct, &path, off as u64, len, &mut buf).unwrap();
            assert_eq!(buf.as_ptr_aligned(), 0, "{off}+{len}: buffer alignment");
            assert_eq!(buf.as_slice().len() % a, 0, "{off}+{len}: whole blocks");
            let mut want = vec![0u8; len];
            read_exact_at(&plain, &path, off as u64, &mut want).unwrap();
            assert_eq!(&buf.as_slice()[skip..skip + len], &want[..], "{off}+{len}");
        }
        let err = read_direct_span(&direct, &path, size as u64 - 2, 3, &mut buf).unwrap_err();
        assert!(err.to_string().contains("file is truncated"), "{err}");
        assert!(!error_refuses_direct(&err));
    }

    #[test]
    fn parallel_runs_every_job_and_reports_the_first_error() {
        let jobs: Vec<u32> = (0..37).collect();
        let mut out = vec![0u32; jobs.len()];
        parallel(Path::new("x"), &jobs, &mut out, 4, |j, o| {
            *o = j * 2;
            Ok(())
        })
        .unwrap();
        assert_eq!(out, jobs.iter().map(|j| j * 2).collect::<Vec<_>>());
        let err = parallel(Path::new("x"), &jobs, &mut out, 3, |j, _| {
            if *j == 20 {
                Err(StreamError::Config("job 20".into()))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "job 20");
    }
}

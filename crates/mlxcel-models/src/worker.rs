//! The thread that owns a model's MLX state, shared by [`crate::Model`] and
//! [`crate::Embedder`]: MLX arrays are not safe to use from several threads at once, so every
//! request runs as a job on this one thread, in arrival order.

use std::sync::mpsc::{channel, Sender, TryRecvError};
use std::sync::Mutex;
use std::thread::JoinHandle;

use crate::{Device, Error, Result};

/// Work a worker's state does between jobs (the steps of running generations). The worker
/// blocks waiting for a job only while its state is not busy.
pub(crate) trait Background {
    /// Whether [`Background::work`] has something to do.
    fn busy(&self) -> bool {
        false
    }

    /// One slice of the work (one decode step), short enough for jobs to interleave.
    fn work(&mut self) {}
}

/// A job for the worker, run on its state `S`.
pub(crate) type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

/// A worker thread owning state `S`, and the channel its jobs arrive on. Dropping it closes the
/// channel and waits for the thread, so the state (the weights) is freed on return.
pub(crate) struct Worker<S> {
    // A `Mutex` keeps `Worker: Sync` on every toolchain the crate supports.
    jobs: Mutex<Sender<Job<S>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<S: Background + 'static> Worker<S> {
    /// Starts thread `name`, selects `device` on it, and builds the state there with `init`,
    /// which also returns what the caller keeps (facts about the model); waits until it is
    /// built, returning `init`'s error when it fails.
    pub(crate) fn start<R: Send + 'static>(
        name: &str,
        device: Option<Device>,
        init: impl FnOnce() -> Result<(S, R)> + Send + 'static,
    ) -> Result<(Worker<S>, R)> {
        let (jobs, inbox) = channel::<Job<S>>();
        let (ready_tx, ready_rx) = channel::<Result<R>>();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let built = (|| {
                    if let Some(d) = device {
                        mlxcel_core::set_default_device(d)?;
                    }
                    init()
                })();
                let mut state = match built {
                    Ok((state, ready)) => {
                        let _ = ready_tx.send(Ok(ready));
                        state
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // Jobs until every handle is dropped, and the work they started is done;
                // while there is work, jobs that arrived meanwhile run between its steps.
                let mut open = true;
                loop {
                    if state.busy() {
                        while open {
                            match inbox.try_recv() {
                                Ok(job) => job(&mut state),
                                Err(TryRecvError::Empty) => break,
                                Err(TryRecvError::Disconnected) => open = false,
                            }
                        }
                        state.work();
                    } else if !open {
                        break;
                    } else {
                        match inbox.recv() {
                            Ok(job) => job(&mut state),
                            Err(_) => break,
                        }
                    }
                }
            })
            .map_err(|e| Error::Invalid(format!("cannot start the {name} thread: {e}")))?;
        let ready = ready_rx.recv().map_err(|_| Error::WorkerGone)??;
        Ok((
            Worker {
                jobs: Mutex::new(jobs),
                thread: Mutex::new(Some(thread)),
            },
            ready,
        ))
    }

    /// Queues `job` without waiting for it.
    pub(crate) fn submit(&self, job: Job<S>) -> Result<()> {
        self.jobs
            .lock()
            .map_err(|_| Error::WorkerGone)?
            .send(job)
            .map_err(|_| Error::WorkerGone)
    }

    /// Runs `job` on the worker and waits for its result.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut S) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = channel();
        self.submit(Box::new(move |state| {
            let _ = tx.send(job(state));
        }))?;
        rx.recv().map_err(|_| Error::WorkerGone)?
    }
}

impl<S> Drop for Worker<S> {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop.
        let (closed, _) = channel::<Job<S>>();
        if let Ok(mut jobs) = self.jobs.lock() {
            *jobs = closed;
        }
        if let Some(handle) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = handle.join();
        }
    }
}

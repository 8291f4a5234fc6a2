//! The learner's one libtorch thread: loading, training steps, collectives,
//! checkpoint bytes, the HF export and the published weights all run here.
//!
//! libtorch's OpenMP keeps a thread team per calling thread and throttles its
//! spin-waits once the process has more team threads than cores (a second
//! team made each policy-server decode step 1.6-1.8x slower, see
//! docs/policy-server.md), and it reads its thread count per calling thread,
//! so `SLEUTH_TORCH_THREADS` only takes effect where it is set. Tokio's
//! blocking pool would run each job on whichever of its threads is free.
//! A learner process is one rank, so one thread serves the whole process.

use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};

use crate::Error;

type Job = Box<dyn FnOnce() + Send>;

static JOBS: OnceLock<Sender<Job>> = OnceLock::new();

fn jobs() -> &'static Sender<Job> {
    JOBS.get_or_init(|| {
        let (sender, receiver) = channel::<Job>();
        std::thread::Builder::new()
            .name("learner-torch".to_owned())
            .spawn(move || receiver.into_iter().for_each(|job| job()))
            .expect("the libtorch thread starts");
        sender
    })
}

/// Runs `f` on the libtorch thread; the caller's task waits without blocking the runtime.
pub async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Error> {
    let (done, result) = tokio::sync::oneshot::channel();
    jobs()
        .send(Box::new(move || {
            let _ = done.send(f());
        }))
        .map_err(|_| Error::Train("the libtorch thread has stopped (a job panicked)".into()))?;
    result.await.map_err(|_| Error::Train("a job on the libtorch thread panicked".into()))
}

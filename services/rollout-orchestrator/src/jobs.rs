//! Evaluation jobs: at most [`MAX_RUNNING`] at once, at most [`MAX_KEPT`]
//! in memory, and each finished one kept on disk (`<report_dir>/<id>.evaluation.pb`),
//! so `GetEvaluation` answers for it after it leaves memory or the
//! orchestrator restarts. Runs' validations are kept the same way, so two
//! versions compare pairwise like any two evaluations (`sleuth compare`). A job that was running when the orchestrator
//! stopped has no file: it is reported as unknown, never as finished.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use prost::Message as _;
use sleuth_proto::rollout::v1::{Evaluation, RunStatus};

/// Evaluations running at once; another is refused until one ends (each
/// runs episodes on the same workers as training).
pub const MAX_RUNNING: usize = 4;
/// Jobs kept in memory; the oldest finished ones leave first (their files stay).
pub const MAX_KEPT: usize = 256;

/// The orchestrator's evaluation jobs (cheap to clone: shared).
#[derive(Clone, Debug)]
pub struct Jobs {
    kept: Arc<Mutex<BTreeMap<String, Evaluation>>>,
    dir: PathBuf,
}

fn running(job: &Evaluation) -> bool {
    job.status == RunStatus::Running as i32
}

impl Jobs {
    /// Jobs whose finished records go to `dir` (the report directory).
    pub fn new(dir: PathBuf) -> Self {
        Self { kept: Arc::default(), dir }
    }

    fn file(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.evaluation.pb"))
    }

    /// Registers a new running job, unless [`MAX_RUNNING`] are running.
    pub fn begin(&self, job: Evaluation) -> Result<(), String> {
        let mut kept = self.kept.lock().expect("jobs");
        let busy = kept.values().filter(|j| running(j)).count();
        if busy >= MAX_RUNNING {
            return Err(format!(
                "{busy} evaluations are running (at most {MAX_RUNNING}); start this one when one ends"
            ));
        }
        kept.insert(job.evaluation_id.clone(), job);
        Ok(())
    }

    /// Changes a running job (its progress).
    pub fn update(&self, id: &str, change: impl FnOnce(&mut Evaluation)) {
        if let Some(job) = self.kept.lock().expect("jobs").get_mut(id) {
            change(job);
        }
    }

    /// Ends a job with `change` (its outcome), writes it to disk, and lets
    /// the oldest finished jobs leave memory beyond [`MAX_KEPT`].
    pub fn finish(&self, id: &str, change: impl FnOnce(&mut Evaluation)) {
        let finished = {
            let mut kept = self.kept.lock().expect("jobs");
            let Some(job) = kept.get_mut(id) else { return };
            change(job);
            let finished = job.clone();
            // `Evaluate`'s ids are time-ordered, so its oldest jobs leave
            // first; a validation's id is not, which costs no more than a
            // read from disk: every finished job stays there.
            let surplus = kept.len().saturating_sub(MAX_KEPT);
            let leaving: Vec<String> =
                kept.iter().filter(|(_, j)| !running(j)).map(|(id, _)| id.clone()).take(surplus).collect();
            for id in leaving {
                kept.remove(&id);
            }
            finished
        };
        if let Err(error) = self.write(&finished) {
            tracing::error!(evaluation = id, %error, "the finished evaluation was not kept on disk");
        }
    }

    /// Keeps `job`, which finished outside the job queue (a run's
    /// validation), so `GetEvaluation` answers for it as for any other.
    pub fn keep(&self, job: Evaluation) {
        let id = job.evaluation_id.clone();
        self.kept.lock().expect("jobs").insert(id.clone(), job);
        self.finish(&id, |_| {});
    }

    /// Written beside the reports, through a temporary file and a rename,
    /// so a reader never sees half of one.
    fn write(&self, job: &Evaluation) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.file(&job.evaluation_id);
        let partial = path.with_extension("pb.partial");
        std::fs::write(&partial, job.encode_to_vec())?;
        std::fs::rename(&partial, &path)
    }

    /// The job `id`: in memory, or finished on disk. `id` must be a plain
    /// name (it names a file).
    pub fn get(&self, id: &str) -> Result<Option<Evaluation>, String> {
        sleuth_kit::names::check_name("evaluation_id", id).map_err(|e| e.to_string())?;
        if let Some(job) = self.kept.lock().expect("jobs").get(id) {
            return Ok(Some(job.clone()));
        }
        match std::fs::read(self.file(id)) {
            Ok(bytes) => Evaluation::decode(bytes.as_slice())
                .map(Some)
                .map_err(|e| format!("{}: unreadable ({e})", self.file(id).display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", self.file(id).display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str) -> Evaluation {
        Evaluation { evaluation_id: id.into(), status: RunStatus::Running as i32, ..Default::default() }
    }

    #[test]
    fn running_jobs_are_bounded_and_finished_ones_outlive_memory_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = Jobs::new(dir.path().to_owned());
        for i in 0..MAX_RUNNING {
            jobs.begin(job(&format!("eval-{i:04}"))).unwrap();
        }
        let refused = jobs.begin(job("eval-busy")).unwrap_err();
        assert!(refused.contains("at most 4"), "{refused}");
        jobs.finish("eval-0000", |j| {
            j.status = RunStatus::Succeeded as i32;
            j.metrics.insert("ndcg@10".into(), 0.5);
        });
        jobs.begin(job("eval-0004")).unwrap();

        // A restarted orchestrator reads the finished job from disk; the
        // ones still running then are unknown, not finished.
        let restarted = Jobs::new(dir.path().to_owned());
        let kept = restarted.get("eval-0000").unwrap().unwrap();
        assert_eq!((kept.status, kept.metrics["ndcg@10"]), (RunStatus::Succeeded as i32, 0.5));
        assert_eq!(restarted.get("eval-0001").unwrap(), None);
        let error = restarted.get("../../etc/passwd").unwrap_err();
        assert!(error.contains("evaluation_id"), "{error}");
    }

    #[test]
    fn a_kept_validation_is_answered_like_a_job_and_takes_no_running_slot() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = Jobs::new(dir.path().to_owned());
        for i in 0..MAX_RUNNING {
            jobs.begin(job(&format!("eval-{i:04}"))).unwrap();
        }
        let mut validation = job("sft-validation-v20");
        validation.status = RunStatus::Succeeded as i32;
        jobs.keep(validation.clone());
        assert_eq!(jobs.get("sft-validation-v20").unwrap(), Some(validation.clone()));
        let restarted = Jobs::new(dir.path().to_owned());
        assert_eq!(restarted.get("sft-validation-v20").unwrap(), Some(validation));
    }

    #[test]
    fn memory_keeps_at_most_the_newest_jobs() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = Jobs::new(dir.path().to_owned());
        for i in 0..MAX_KEPT + 10 {
            let id = format!("eval-{i:05}");
            jobs.begin(job(&id)).unwrap();
            jobs.finish(&id, |j| j.status = RunStatus::Succeeded as i32);
        }
        assert_eq!(jobs.kept.lock().unwrap().len(), MAX_KEPT);
        assert!(jobs.get("eval-00000").unwrap().is_some(), "the oldest is still answered from disk");
    }
}

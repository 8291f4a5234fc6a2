//! Pause points for race tests: a named place in a service's code where a
//! test in the same process can hold every task that gets there, see that
//! one did, make something else happen meanwhile, and let them go. A race
//! found this way fails the same way on every machine, where a sleep only
//! makes it likely. Like [`crate::fault`], nothing outside the process can
//! arm a point, and an unarmed point costs one atomic load.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;

/// Points armed now, so that [`point`] skips the lock when there are none.
static ARMED: AtomicUsize = AtomicUsize::new(0);
/// Each armed point: how many tasks reached it, and whether it is released.
static POINTS: Mutex<Vec<(String, Gate)>> = Mutex::new(Vec::new());

#[derive(Clone)]
struct Gate {
    reached: watch::Sender<usize>,
    released: watch::Sender<bool>,
}

fn points() -> std::sync::MutexGuard<'static, Vec<(String, Gate)>> {
    POINTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A place where a test may hold a task: waits while `name` is armed and
/// not yet released.
pub async fn point(name: &str) {
    if ARMED.load(Ordering::Acquire) == 0 {
        return;
    }
    let gate = points().iter().find(|(point, _)| point == name).map(|(_, gate)| gate.clone());
    let Some(gate) = gate else { return };
    let mut released = gate.released.subscribe();
    gate.reached.send_modify(|count| *count += 1);
    // Dropping the test's `Paused` releases too, so a failing test leaves no task held.
    let _ = released.wait_for(|&go| go).await;
}

/// A point armed by a test: tasks reaching it wait until [`Paused::release`]
/// (or until this is dropped, so a failing test never leaves a task stuck).
pub struct Paused {
    name: String,
    gate: Gate,
}

/// Arms the point `name` (re-arming replaces an earlier arming).
pub fn arm(name: &str) -> Paused {
    let gate = Gate { reached: watch::channel(0).0, released: watch::channel(false).0 };
    let mut points = points();
    points.retain(|(point, _)| point != name);
    points.push((name.to_owned(), gate.clone()));
    ARMED.store(points.len(), Ordering::Release);
    Paused { name: name.to_owned(), gate }
}

impl Paused {
    /// Waits until `tasks` tasks in all have reached the point.
    pub async fn reached(&self, tasks: usize) {
        let mut reached = self.gate.reached.subscribe();
        let _ = reached.wait_for(|&count| count >= tasks).await;
    }

    /// Lets every task held at the point go on, and disarms it.
    pub fn release(self) {
        drop(self);
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let mut points = points();
        points.retain(|(point, gate)| !(point == &self.name && gate.released.same_channel(&self.gate.released)));
        ARMED.store(points.len(), Ordering::Release);
        drop(points);
        self.gate.released.send_replace(true);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_held_task_goes_on_only_once_released() {
        point("kit-nothing-armed").await;
        let paused = arm("kit-pause-point");
        let held = tokio::spawn(async { point("kit-pause-point").await });
        paused.reached(1).await;
        point("kit-another-point").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!held.is_finished(), "a task at an armed point waits");
        paused.release();
        tokio::time::timeout(Duration::from_secs(5), held).await.expect("released").expect("no panic");
        point("kit-pause-point").await; // disarmed: passes straight
    }
}

//! Fault injection for tests: a named point in a service's code that panics,
//! as a libtorch or driver error would, when a test in the same process has
//! armed it. Nothing outside the process can arm a point (there is no flag
//! or environment variable for it), and an unarmed point costs one atomic
//! load, so points stay in release builds where the faults they stand for
//! happen.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Points armed now, so that [`point`] skips the lock when there are none.
static ARMED: AtomicUsize = AtomicUsize::new(0);
/// Each armed point and how many more passes through it panic.
static POINTS: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());

/// Makes the next `times` passes through the point `name`, from any thread of
/// this process, panic.
pub fn arm(name: &str, times: u32) {
    let mut points = POINTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    points.retain(|(point, _)| point != name);
    if times > 0 {
        points.push((name.to_owned(), times));
    }
    ARMED.store(points.len(), Ordering::Release);
}

/// A place where a fault can strike: panics when `name` is armed.
pub fn point(name: &str) {
    if ARMED.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut points = POINTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(index) = points.iter().position(|(point, _)| point == name) else { return };
    points[index].1 -= 1;
    if points[index].1 == 0 {
        points.remove(index);
        ARMED.store(points.len(), Ordering::Release);
    }
    drop(points);
    panic!("fault injected at {name}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_armed_point_panics_as_many_times_as_armed() {
        point("nothing-armed");
        arm("kit-test-point", 2);
        point("another-point");
        for _ in 0..2 {
            let panicked = std::panic::catch_unwind(|| point("kit-test-point")).unwrap_err();
            assert_eq!(panicked.downcast_ref::<String>().map(String::as_str), Some("fault injected at kit-test-point"));
        }
        point("kit-test-point");
    }
}

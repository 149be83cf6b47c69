//! A calibration hook: while [`with_linear_observer`] runs, every dense [`super::Linear`] and
//! dense [`super::SwitchLinear`] forward reports `(weight, input)` to the observer (repacking uses
//! it to measure per-input-channel activation energy). Off, it costs one thread-local check.

use std::cell::RefCell;

use mlxcel_core::Array;

type Observer = Box<dyn FnMut(&Array, &Array)>;

thread_local! {
    static OBSERVER: RefCell<Option<Observer>> = const { RefCell::new(None) };
}

/// Runs `f` with `observer` receiving `(weight, input)` of every dense linear forward.
pub fn with_linear_observer<R>(observer: Observer, f: impl FnOnce() -> R) -> R {
    let previous = OBSERVER.with(|o| o.borrow_mut().replace(observer));
    let out = f();
    OBSERVER.with(|o| *o.borrow_mut() = previous);
    out
}

pub(crate) fn observe(weight: &Array, x: &Array) {
    // Taken out while it runs, so an observer that itself runs a linear does not re-enter.
    let Some(mut obs) = OBSERVER.with(|o| o.borrow_mut().take()) else {
        return;
    };
    obs(weight, x);
    OBSERVER.with(|o| {
        let mut slot = o.borrow_mut();
        if slot.is_none() {
            *slot = Some(obs);
        }
    });
}

//! Heap allocations, counted: a global allocator that passes every call to the system allocator
//! and, while [`counting`] is on, counts allocations, for the rows that report allocations per
//! request. Only a program that installs [`Counting`] as its `#[global_allocator]` counts;
//! elsewhere [`allocations`] stays 0. Counting is off by default, so that the other rows pay
//! one relaxed load per allocation and not a counter every thread writes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Allocations (and reallocations) made while counting.
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// Whether allocations are counted now.
static COUNTING: AtomicBool = AtomicBool::new(false);

/// Counts one allocation, if counting.
fn count() {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Turns counting on or off.
pub fn counting(on: bool) {
    COUNTING.store(on, Ordering::Relaxed);
}

/// The system allocator, counting.
pub struct Counting;

// SAFETY: every call is passed on unchanged to `System`, which upholds the contract; the
// counter is only an atomic increment beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's guarantees for `layout` are `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: `ptr` was allocated by this allocator, so by `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator, so by `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations counted so far (while [`counting`] was on).
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

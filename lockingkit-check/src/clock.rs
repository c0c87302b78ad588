//! The one clock every history uses: `CLOCK_MONOTONIC`, in nanoseconds.
//!
//! `std::time::Instant` reads the same clock on Linux but cannot be compared across processes;
//! `clock_gettime(CLOCK_MONOTONIC)` gives a number every process on the machine shares, so the
//! client processes' events and the register's can be put on one time line.
//!
//! It is read with the system call itself, not through the C library: a client whose clock the
//! nemesis skews runs with libfaketime preloaded, which fakes the C library's `clock_gettime`
//! (and so `Instant`, and the lock's deadlines), while its history must stay on real time.

/// Nanoseconds on `CLOCK_MONOTONIC`.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec that outlives the call; CLOCK_MONOTONIC
    // exists on every Linux.
    let status = unsafe {
        libc::syscall(
            libc::SYS_clock_gettime,
            libc::CLOCK_MONOTONIC,
            &mut now as *mut libc::timespec,
        )
    };
    if status != 0 {
        // Cannot happen for CLOCK_MONOTONIC; a 0 would show as an obviously wrong time.
        return 0;
    }
    let seconds = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec).unwrap_or(0);
    seconds.saturating_mul(1_000_000_000).saturating_add(nanos)
}

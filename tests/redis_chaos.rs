//! Chaos cases for the Redis provider (filled in below).

//! Faults injected into real etcd clusters.

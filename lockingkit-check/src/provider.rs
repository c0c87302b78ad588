//! The providers a run can check: how a client process builds its lock, which server the
//! harness starts for them, which faults that server can suffer, and what the provider's
//! documentation promises (the [`Guarantees`] the checker allows for).

use std::time::Duration;

use lockingkit::{
    AzureBlobBackend, AzureBlobOptions, DistributedLock, EtcdBackend, EtcdOptions, MysqlBackend,
    MysqlOptions, PostgresBackend, PostgresOptions, RedisBackend, RedisOptions,
};
use lockingkit_tests::azurite::{Azurite, Persistence, DEV_ACCOUNT, DEV_KEY};
use lockingkit_tests::etcd::EtcdCluster;
use lockingkit_tests::mariadb::{MariaDbServer, APP_PASSWORD, APP_USER, DATABASE};
use lockingkit_tests::pgbouncer::{PgBouncer, PoolMode};
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::redis::{RedisCluster, RedisServer};

use crate::checker::Guarantees;
use crate::error::CheckError;
use crate::history::FaultKind;
use crate::nemesis::EndFuture;

/// The lease of the in-memory and Redis runs: short, so that a pause means something.
pub const LEASE: Duration = Duration::from_secs(1);

/// The etcd runs' lease: etcd counts TTLs in whole seconds from 2 s, and a three-member cluster
/// on a loaded machine needs room for an election within it.
pub const ETCD_LEASE: Duration = Duration::from_secs(3);

/// The Azure runs' lease: Azure Blob leases last 15 to 60 s.
pub const AZURE_LEASE: Duration = Duration::from_secs(15);

/// How often a PostgreSQL hold checks its session (directly or through PgBouncer), and a
/// MySQL one its session.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// The backend a run checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    /// The in-memory provider, clients as tasks on one store.
    Memory,
    /// A local PostgreSQL server.
    Postgres,
    /// A local PostgreSQL server behind PgBouncer in session mode.
    PgBouncer,
    /// A local MariaDB server (the MySQL provider).
    Mysql,
    /// A single local Redis server (no persistence).
    Redis,
    /// A Redis Cluster of three primaries (no persistence, no replicas); clients reach the
    /// nodes directly (the cluster hands out its nodes' own addresses), so there are no
    /// partitions, and a server fault strikes one node.
    RedisCluster,
    /// Azurite (on disk), the Azure Blob provider's stand-in; a 15 s lease. Azurite, unlike
    /// Azure Storage, keeps no lease across its restart.
    Azure,
    /// A one-member etcd cluster.
    Etcd,
    /// A three-member etcd cluster; the server faults strike its leader.
    Etcd3,
}

impl Provider {
    /// Every provider, in the order the report lists them.
    pub const ALL: [Provider; 9] = [
        Provider::Memory,
        Provider::Postgres,
        Provider::PgBouncer,
        Provider::Mysql,
        Provider::Redis,
        Provider::RedisCluster,
        Provider::Etcd,
        Provider::Etcd3,
        Provider::Azure,
    ];

    /// From its command-line name.
    pub fn parse(name: &str) -> Result<Provider, CheckError> {
        Provider::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Provider::ALL.iter().map(|p| p.name()).collect();
                CheckError::Usage(format!("unknown provider {name:?} ({})", names.join(", ")))
            })
    }

    /// Its command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Memory => "memory",
            Provider::Postgres => "postgres",
            Provider::PgBouncer => "pgbouncer",
            Provider::Mysql => "mysql",
            Provider::Redis => "redis",
            Provider::RedisCluster => "redis-cluster",
            Provider::Azure => "azure",
            Provider::Etcd => "etcd",
            Provider::Etcd3 => "etcd3",
        }
    }

    /// The lease of its holds, or for a session-held lock the yardstick of pauses and
    /// partitions.
    pub fn lease(self) -> Duration {
        match self {
            Provider::Etcd | Provider::Etcd3 => ETCD_LEASE,
            Provider::Azure => AZURE_LEASE,
            _ => LEASE,
        }
    }

    /// The options its clients run with and what the checker allows it, as the report's
    /// header prints them.
    pub fn options(self) -> String {
        let lock = match self {
            Provider::Memory => format!("lease {LEASE:?}"),
            Provider::Postgres | Provider::PgBouncer | Provider::Mysql => {
                format!("session-held, checked every {CHECK_INTERVAL:?}")
            }
            Provider::Redis | Provider::RedisCluster => format!(
                "lease {LEASE:?}, request timeout {:?}, writer intent {:?}",
                LEASE / 3,
                LEASE / 2
            ),
            Provider::Azure => format!(
                "lease {AZURE_LEASE:?}, request timeout {:?}",
                AZURE_LEASE / 3
            ),
            Provider::Etcd | Provider::Etcd3 => {
                format!("lease {ETCD_LEASE:?}, request timeout {:?}", ETCD_LEASE / 3)
            }
        };
        let g = self.guarantees();
        let allows = match (g.session_held, g.restart_loses_locks) {
            (true, _) => "a session freed under a fault on its holder",
            (false, true) => "a server restart losing every lock",
            (false, false) => "nothing",
        };
        format!(
            "{lock}; retries {MIN_RETRY:?}-{MAX_RETRY:?}; semaphore of {} on {}, leader key {}; \
             the checker allows {allows}",
            crate::client::SEMAPHORE_PERMITS,
            crate::client::SEMAPHORE_KEY,
            crate::client::LEADER_KEY
        )
    }

    /// What its documentation promises, for the checker (see [`Guarantees`]).
    pub fn guarantees(self) -> Guarantees {
        match self {
            Provider::Postgres | Provider::PgBouncer | Provider::Mysql => Guarantees {
                session_held: true,
                ..Guarantees::default()
            },
            // The fixture's Redis servers persist nothing, and Azurite keeps no blob lease
            // across its own restart, even a graceful one (Azure Storage does).
            Provider::Redis | Provider::RedisCluster | Provider::Azure => Guarantees {
                restart_loses_locks: true,
                ..Guarantees::default()
            },
            Provider::Memory | Provider::Etcd | Provider::Etcd3 => Guarantees::default(),
        }
    }

    /// The faults the nemesis draws for client processes of this provider. Drawn uniformly;
    /// the fault that makes stale holders is listed twice: on a lease the long pause (the lease
    /// runs out), on a session-held lock the reset (a session keeps its lock through any pause
    /// or partition; only a closed connection frees it under a live holder).
    pub fn kinds(self) -> &'static [FaultKind] {
        match self {
            Provider::RedisCluster => &[
                FaultKind::Kill,
                FaultKind::PauseShort,
                FaultKind::PauseLong,
                FaultKind::PauseLong,
                FaultKind::ServerCrash,
                FaultKind::ServerPause,
            ],
            Provider::Postgres | Provider::PgBouncer | Provider::Mysql => &[
                FaultKind::Kill,
                FaultKind::PauseShort,
                FaultKind::PauseLong,
                FaultKind::Blackhole,
                FaultKind::Reset,
                FaultKind::Reset,
                FaultKind::Delay,
                FaultKind::ServerCrash,
                FaultKind::ServerPause,
            ],
            _ => &[
                FaultKind::Kill,
                FaultKind::PauseShort,
                FaultKind::PauseLong,
                FaultKind::PauseLong,
                FaultKind::Blackhole,
                FaultKind::Reset,
                FaultKind::Delay,
                FaultKind::ServerCrash,
                FaultKind::ServerPause,
            ],
        }
    }
}

/// The engine's retry delays in every client: quick, so a freed key is taken again soon.
const MIN_RETRY: Duration = Duration::from_millis(10);
const MAX_RETRY: Duration = Duration::from_millis(100);

/// The engine options every client uses: quick retries, so a freed key is taken again soon.
pub fn build(
    backend: impl lockingkit::backend::LockBackend,
) -> Result<DistributedLock, CheckError> {
    Ok(DistributedLock::builder(backend)
        .min_retry_delay(MIN_RETRY)
        .max_retry_delay(MAX_RETRY)
        .build()?)
}

/// A client's lock on a server, through `address` (its proxies): how a client process builds it.
pub fn server_lock(provider: Provider, address: &str) -> Result<DistributedLock, CheckError> {
    match provider {
        Provider::Memory => Err(CheckError::Usage(
            "the memory provider has no client processes".into(),
        )),
        Provider::Postgres | Provider::PgBouncer => build(PostgresBackend::new(
            PostgresOptions::new(address.to_string()).with_check_interval(CHECK_INTERVAL),
        )?),
        Provider::Mysql => build(MysqlBackend::new(
            MysqlOptions::new(address.to_string()).with_check_interval(CHECK_INTERVAL),
        )?),
        Provider::Redis | Provider::RedisCluster => build(RedisBackend::new(
            RedisOptions::new(address.to_string())
                .with_cluster(provider == Provider::RedisCluster)
                .with_lease_duration(LEASE)
                .with_request_timeout(LEASE / 3)
                // A writer's intent must fit in the lease (the default is longer than 1 s).
                .with_writer_intent(LEASE / 2),
        )?),
        Provider::Azure => build(AzureBlobBackend::new(
            AzureBlobOptions::from_connection_string(address.to_string())
                .with_container("locks")
                .with_lease_duration(AZURE_LEASE)
                .with_request_timeout(AZURE_LEASE / 3),
        )?),
        Provider::Etcd | Provider::Etcd3 => build(EtcdBackend::new(
            EtcdOptions::new(address.split(',').map(str::to_string))
                .with_lease_ttl(ETCD_LEASE)
                .with_request_timeout(ETCD_LEASE / 3),
        )?),
    }
}

/// The address a client process is given for a server behind its proxies on `ports`.
pub fn backend_address(provider: Provider, ports: &[u16]) -> String {
    let first = ports.first().copied().unwrap_or(0);
    match provider {
        Provider::Postgres | Provider::PgBouncer => {
            format!("host=127.0.0.1 port={first} user=postgres dbname=postgres sslmode=disable")
        }
        Provider::Mysql => {
            format!("mysql://{APP_USER}:{APP_PASSWORD}@127.0.0.1:{first}/{DATABASE}")
        }
        Provider::Etcd | Provider::Etcd3 => ports
            .iter()
            .map(|port| format!("http://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(","),
        Provider::Memory | Provider::Redis | Provider::RedisCluster => ports
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(","),
        Provider::Azure => format!(
            "DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};\
             AccountKey={DEV_KEY};BlobEndpoint=http://127.0.0.1:{first}/{DEV_ACCOUNT}"
        ),
    }
}

/// The backend server of a run, which the nemesis crashes and pauses.
pub trait Server: Send {
    /// The ports clients connect to (each client gets a proxy to each).
    fn ports(&self) -> Vec<u16>;
    /// Whether clients go through proxies; a Redis Cluster hands its clients its nodes' own
    /// addresses, so a proxy would see only the first connection.
    fn proxied(&self) -> bool {
        true
    }
    /// Kills the server (SIGKILL), or for a cluster its leader.
    fn crash(&mut self) -> EndFuture<'_>;
    /// Starts what [`crash`](Self::crash) killed again, on its ports.
    fn start_again(&mut self) -> EndFuture<'_>;
    /// Freezes the server (SIGSTOP), or for a cluster its leader.
    fn pause(&mut self) -> EndFuture<'_>;
    /// Thaws what [`pause`](Self::pause) froze.
    fn resume(&mut self);
}

/// Runs a fixture's start, which panics when it cannot start, as a task: a panic becomes a
/// harness error instead of a crash.
pub async fn start_fixture<T: Send + 'static>(
    what: &str,
    start: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, CheckError> {
    tokio::spawn(start)
        .await
        .map_err(|e| CheckError::Server(format!("{what}: {e}")))
}

/// Starts the server `provider`'s clients lock on (none for the in-memory provider).
pub async fn start_server(provider: Provider) -> Result<Option<Box<dyn Server>>, CheckError> {
    Ok(Some(match provider {
        Provider::Memory => return Ok(None),
        Provider::Postgres => {
            Box::new(start_fixture("PostgreSQL", PostgresServer::start_local()).await?)
        }
        Provider::PgBouncer => Box::new(
            start_fixture("PgBouncer", async {
                let postgres = PostgresServer::start_local().await;
                // PgBouncer refuses logins for `server_login_retry` (15 s by default) after a failed
                // server login; a crash of the server would idle the rest of a short run.
                let bouncer =
                    PgBouncer::start_with(&postgres, PoolMode::Session, "server_login_retry = 1\n")
                        .await;
                Pooled { postgres, bouncer }
            })
            .await?,
        ),
        Provider::Mysql => Box::new(start_fixture("MariaDB", MariaDbServer::start_local()).await?),
        Provider::Redis => Box::new(start_fixture("Redis", RedisServer::start()).await?),
        Provider::RedisCluster => Box::new(Nodes {
            cluster: start_fixture("Redis Cluster", RedisCluster::start()).await?,
        }),
        Provider::Azure => {
            Box::new(start_fixture("Azurite", Azurite::start_local(Persistence::OnDisk)).await?)
        }
        Provider::Etcd | Provider::Etcd3 => {
            let three = provider == Provider::Etcd3;
            let cluster = start_fixture("etcd", async move {
                if three {
                    EtcdCluster::three().await
                } else {
                    EtcdCluster::single().await
                }
            })
            .await?;
            Box::new(Cluster {
                cluster,
                struck: None,
            })
        }
    }))
}

/// Done at once.
fn done<'a>() -> EndFuture<'a> {
    Box::pin(async { Ok(()) })
}

/// A server fixture that is one process: crashed, started again, paused and resumed by its
/// own methods of those names.
macro_rules! single_server {
    ($server:ty) => {
        impl Server for $server {
            fn ports(&self) -> Vec<u16> {
                vec![self.port()]
            }
            fn crash(&mut self) -> EndFuture<'_> {
                self.kill();
                done()
            }
            fn start_again(&mut self) -> EndFuture<'_> {
                Box::pin(async move {
                    <$server>::start_again(self).await;
                    Ok(())
                })
            }
            fn pause(&mut self) -> EndFuture<'_> {
                <$server>::pause(self);
                done()
            }
            fn resume(&mut self) {
                <$server>::resume(self);
            }
        }
    };
}

single_server!(PostgresServer);
single_server!(MariaDbServer);
single_server!(RedisServer);

/// PostgreSQL behind PgBouncer in session mode; the server faults strike PostgreSQL.
struct Pooled {
    postgres: PostgresServer,
    bouncer: PgBouncer,
}

impl Server for Pooled {
    fn ports(&self) -> Vec<u16> {
        vec![self.bouncer.port()]
    }
    fn crash(&mut self) -> EndFuture<'_> {
        Server::crash(&mut self.postgres)
    }
    fn start_again(&mut self) -> EndFuture<'_> {
        Server::start_again(&mut self.postgres)
    }
    fn pause(&mut self) -> EndFuture<'_> {
        Server::pause(&mut self.postgres)
    }
    fn resume(&mut self) {
        Server::resume(&mut self.postgres);
    }
}

/// An etcd cluster; the server faults strike its leader, found when the fault begins.
struct Cluster {
    cluster: EtcdCluster,
    /// The member the fault in progress struck.
    struck: Option<usize>,
}

impl Server for Cluster {
    fn ports(&self) -> Vec<u16> {
        self.cluster
            .endpoints()
            .iter()
            .filter_map(|url| url.rsplit(':').next()?.parse().ok())
            .collect()
    }
    fn crash(&mut self) -> EndFuture<'_> {
        Box::pin(async move {
            let leader = self.cluster.leader().await;
            self.cluster.kill(leader);
            self.struck = Some(leader);
            Ok(())
        })
    }
    fn start_again(&mut self) -> EndFuture<'_> {
        Box::pin(async move {
            if let Some(member) = self.struck.take() {
                self.cluster.restart(member).await;
            }
            Ok(())
        })
    }
    fn pause(&mut self) -> EndFuture<'_> {
        Box::pin(async move {
            let leader = self.cluster.leader().await;
            self.cluster.pause(leader);
            self.struck = Some(leader);
            Ok(())
        })
    }
    fn resume(&mut self) {
        if let Some(member) = self.struck.take() {
            self.cluster.resume(member);
        }
    }
}

/// A Redis Cluster; the server faults strike its first node (a primary of a third of the
/// slots), whose keys are gone when it comes back (nothing is persisted).
struct Nodes {
    cluster: RedisCluster,
}

impl Server for Nodes {
    fn ports(&self) -> Vec<u16> {
        self.cluster.nodes().iter().map(RedisServer::port).collect()
    }
    fn proxied(&self) -> bool {
        false
    }
    fn crash(&mut self) -> EndFuture<'_> {
        self.cluster.nodes_mut()[0].kill();
        done()
    }
    fn start_again(&mut self) -> EndFuture<'_> {
        Box::pin(async move {
            self.cluster.nodes_mut()[0].start_again().await;
            Ok(())
        })
    }
    fn pause(&mut self) -> EndFuture<'_> {
        self.cluster.nodes_mut()[0].pause();
        done()
    }
    fn resume(&mut self) {
        self.cluster.nodes_mut()[0].resume();
    }
}

/// Azurite on disk. Its "crash" is a graceful stop: killed, Azurite may lose its last seconds
/// of writes (fencing tokens among them), which Azure Storage does not.
impl Server for Azurite {
    fn ports(&self) -> Vec<u16> {
        vec![self.port()]
    }
    fn crash(&mut self) -> EndFuture<'_> {
        self.stop();
        done()
    }
    fn start_again(&mut self) -> EndFuture<'_> {
        Box::pin(async move {
            self.restart().await;
            Ok(())
        })
    }
    fn pause(&mut self) -> EndFuture<'_> {
        Azurite::pause(self);
        done()
    }
    fn resume(&mut self) {
        Azurite::resume(self);
    }
}

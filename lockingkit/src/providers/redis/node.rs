//! One connection to one Redis node: the server, or one node of a cluster (the cluster client
//! opens those through [`Connect`]). Beyond the `redis` crate's multiplexed connection it keeps
//! two promises the server can see:
//!
//! - **No `CLIENT SETINFO`** in the handshake: servers before 7.2 answer it with `ERR`, twice per
//!   connection. The crate's cluster client builds each node's connection settings itself and
//!   leaves that flag out (redis 1.8), so it is set again here, on whatever settings arrive.
//! - **Each script loaded before it first runs**: a request that runs one of the protocol's
//!   scripts by SHA waits until this connection has loaded it (`SCRIPT LOAD`), with one load in
//!   flight per script however many requests need it. So a new connection — to a server that
//!   restarted, a promoted replica, a node the slot map added — draws no `NOSCRIPT`. A
//!   `NOSCRIPT` answer means the node lost its script cache under the connection (`SCRIPT
//!   FLUSH`), which empties it of every script at once: the connection forgets them all, so
//!   each is loaded again before its next use, and the caller sends its request again (see
//!   `eval`). Requests already sent when the cache was emptied draw one `NOSCRIPT` each; no
//!   client can call those back.
//!
//! The scripts are recognised in the commands themselves (`EVALSHA sha …`), because on a cluster
//! only the cluster client knows which node a request reaches: the node's own connection is the
//! one place that sees both the request and the node.

use std::sync::{Arc, Mutex};

use futures_util::FutureExt;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::Connect;
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, ServerErrorKind, Value,
};
use tokio::sync::OnceCell;

use super::errors;
use super::eval::{Scripts, SCRIPT_COUNT};
use super::locked;

/// `info` without the `CLIENT SETINFO` step of the handshake.
pub(super) fn without_client_setinfo(info: ConnectionInfo) -> ConnectionInfo {
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    info.set_redis_settings(settings)
}

/// A multiplexed connection to one node, with what it knows of the node's script cache.
#[derive(Clone)]
pub(super) struct NodeConnection {
    connection: MultiplexedConnection,
    cache: Arc<ScriptCache>,
}

impl NodeConnection {
    /// Wraps a connection just opened: no script is known to be loaded on it yet.
    pub(super) fn new(connection: MultiplexedConnection) -> Self {
        NodeConnection {
            connection,
            cache: Arc::new(ScriptCache {
                current: Mutex::new(Arc::new(Loaded::none())),
            }),
        }
    }

    /// Loads every protocol script that `commands` run by SHA and this connection has not
    /// loaded yet, and answers what the scripts were checked against.
    async fn load_for<'c>(
        &self,
        commands: impl Iterator<Item = &'c Cmd>,
    ) -> RedisResult<Arc<Loaded>> {
        let loaded = locked(&self.cache.current).clone();
        for index in commands.filter_map(script_run_by) {
            let mut connection = self.connection.clone();
            loaded.scripts[index]
                .get_or_try_init(|| async move {
                    let mut load = redis::cmd("SCRIPT");
                    load.arg("LOAD")
                        .arg(Scripts::protocol().all()[index].source());
                    connection
                        .req_packed_command(&load)
                        .await?
                        .extract_error()?;
                    RedisResult::Ok(())
                })
                .await?;
        }
        Ok(loaded)
    }

    /// After an answer that says the node lacks a script: forgets every script loaded in
    /// `loaded`, unless a request that saw the same emptied cache did so already.
    fn forget(&self, loaded: &Arc<Loaded>) {
        let mut current = locked(&self.cache.current);
        if Arc::ptr_eq(&current, loaded) {
            *current = Arc::new(Loaded::none());
        }
    }
}

/// What one connection knows of its node's script cache.
struct ScriptCache {
    /// The scripts loaded since the connection opened or last saw `NOSCRIPT`; replaced, not
    /// cleared, so that requests answered `NOSCRIPT` from one emptied cache forget it once.
    current: Mutex<Arc<Loaded>>,
}

/// One cell per script of [`Scripts::all`], set once it is loaded; a load in flight is the cell
/// being initialised, which every other request for the script waits on.
struct Loaded {
    scripts: [OnceCell<()>; SCRIPT_COUNT],
}

impl Loaded {
    fn none() -> Self {
        Loaded {
            scripts: std::array::from_fn(|_| OnceCell::new()),
        }
    }
}

/// The protocol script `cmd` runs by SHA, as its index in [`Scripts::all`].
fn script_run_by(cmd: &Cmd) -> Option<usize> {
    let mut args = cmd.args_iter();
    match (args.next(), args.next()) {
        (Some(Arg::Simple(name)), Some(Arg::Simple(sha)))
            if name.eq_ignore_ascii_case(b"EVALSHA") =>
        {
            Scripts::protocol().position(sha)
        }
        _ => None,
    }
}

/// Whether the server answered that it does not have a script, in place of an answer or as
/// the error of the whole request.
fn lacks_script<'v>(answered: Result<impl IntoIterator<Item = &'v Value>, &RedisError>) -> bool {
    match answered {
        Ok(values) => values.into_iter().any(|value| {
            matches!(value, Value::ServerError(error) if error.kind() == Some(ServerErrorKind::NoScript))
        }),
        Err(error) => errors::is_missing_script(error),
    }
}

impl ConnectionLike for NodeConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        async move {
            let loaded = self.load_for(std::iter::once(cmd)).await?;
            let answer = self.connection.req_packed_command(cmd).await;
            if lacks_script(answer.as_ref().map(std::iter::once)) {
                self.forget(&loaded);
            }
            answer
        }
        .boxed()
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        async move {
            let loaded = self.load_for(pipeline.cmd_iter()).await?;
            let answers = self
                .connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            if lacks_script(answers.as_ref()) {
                self.forget(&loaded);
            }
            answers
        }
        .boxed()
    }

    fn get_db(&self) -> i64 {
        self.connection.get_db()
    }
}

impl Connect for NodeConnection {
    fn connect_with_config<'a, T>(info: T, config: AsyncConnectionConfig) -> RedisFuture<'a, Self>
    where
        T: IntoConnectionInfo + Send + 'a,
    {
        async move {
            let info = without_client_setinfo(info.into_connection_info()?);
            redis::Client::open(info)?
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map(NodeConnection::new)
        }
        .boxed()
    }
}

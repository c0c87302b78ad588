//! The MariaDB fixture itself (`lockingkit_tests::mariadb`), before any provider runs on it:
//! the server answers as MariaDB to the application account, a named lock taken in one client
//! session is refused to another until it is released or its connection killed, and data
//! survives a restart and a crash.

use lockingkit_tests::mariadb::{MariaDbServer, APP_PASSWORD};

/// The lock name the fixture's own tests take.
const NAME: &str = "lockingkit-fixture";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_lock_held_by_one_cli_session_is_refused_to_another_until_released() {
    let server = MariaDbServer::start().await;
    let version = server
        .sql_as_app("SELECT VERSION()")
        .expect("SELECT VERSION()");
    assert!(version.contains("MariaDB"), "VERSION() is {version:?}");
    if !server.is_external() {
        let port = server.port();
        assert_eq!(
            server.url(),
            format!("mysql://lockingkit:{APP_PASSWORD}@127.0.0.1:{port}/lockingkit")
        );
    }

    let mut holder = server.session();
    let mut other = server.session();
    let take = format!("SELECT GET_LOCK('{NAME}', 0)");
    assert_eq!(holder.run(&take), ["1"]);
    assert_eq!(other.run(&take), ["0"], "a second session got a held lock");
    let holder_id = holder.connection_id();
    assert_eq!(
        other.run(&format!("SELECT IS_USED_LOCK('{NAME}')")),
        [holder_id.to_string()]
    );

    assert_eq!(holder.run(&format!("SELECT RELEASE_LOCK('{NAME}')")), ["1"]);
    assert_eq!(other.run(&take), ["1"], "a released lock stayed held");

    // A session's named locks end with its connection.
    let other_id = other.connection_id();
    server.kill_connection(other_id).expect("KILL");
    assert_eq!(holder.run(&format!("SELECT GET_LOCK('{NAME}', 5)")), ["1"]);
    assert_eq!(holder.run(&format!("SELECT RELEASE_LOCK('{NAME}')")), ["1"]);
    if !server.is_external() {
        server.assert_no_errors_logged();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_and_a_crash_keep_committed_data_and_the_port() {
    let mut server = MariaDbServer::start_local().await;
    let port = server.port();
    server
        .sql_as_app("CREATE TABLE kept (id INT PRIMARY KEY); INSERT INTO kept VALUES (1)")
        .expect("CREATE TABLE");

    server.restart().await;
    assert_eq!(server.port(), port);
    assert_eq!(server.sql_as_app("SELECT id FROM kept"), Ok("1".to_owned()));

    // Every commit is flushed (the default): a kill right after one loses nothing.
    server
        .sql_as_app("INSERT INTO kept VALUES (2)")
        .expect("INSERT");
    server.kill();
    server.start_again().await;
    assert_eq!(
        server.sql_as_app("SELECT id FROM kept ORDER BY id"),
        Ok("1\n2".to_owned())
    );
    server.assert_no_errors_logged();
}

//! What depending on `lockingkit` brings into a build, read from its manifest with
//! `cargo metadata`: a library that takes locks must not compile a pool it never uses.

use serde_json::Value;

/// lockingkit's package entry in `cargo metadata` (its own manifest, no resolution).
fn lockingkit_package() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let output = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--offline",
            "--format-version",
            "1",
        ])
        .args(["--manifest-path", manifest])
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .find(|p| p["name"] == "lockingkit")
        .expect("the lockingkit package")
        .clone()
}

#[test]
fn deadpool_postgres_is_built_only_for_the_deadpool_feature_or_our_own_tests() {
    let package = lockingkit_package();
    let entries: Vec<&Value> = package["dependencies"]
        .as_array()
        .expect("dependencies")
        .iter()
        .filter(|d| d["name"] == "deadpool-postgres")
        .collect();
    for entry in &entries {
        let dev = entry["kind"] == "dev";
        let optional = entry["optional"] == true;
        assert!(
            dev || optional,
            "deadpool-postgres is a dependency of every build: {entry}"
        );
    }
    let features = package["features"].as_object().expect("features");
    for (feature, enables) in features {
        let enables_deadpool = enables
            .as_array()
            .expect("a feature's list")
            .iter()
            .any(|e| e.as_str().is_some_and(|e| e.contains("deadpool-postgres")));
        assert!(
            !enables_deadpool || feature == "deadpool",
            "feature {feature} builds deadpool-postgres: {enables}"
        );
    }
}

//! `scripts/kafka prepare` leases the ports it chooses for its caller, in the leases the Rust
//! harnesses read (`idem_conformance::ports::lease`): no test beside it takes a port of the
//! cluster before its node binds it, nor while the node is down.

use idem_conformance::kafka::script;
use idem_conformance::ports::lease::{Leases, Owner};
use std::process::Command;

#[test]
fn the_ports_a_prepared_cluster_chose_are_leased_to_its_caller() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(script())
        .args(["prepare", "--nodes", "1", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let ports: Vec<u16> = std::fs::read_to_string(dir.path().join("ports"))
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(ports.len(), 2, "a client and a controller port: {ports:?}");
    let me = Owner::this_process().unwrap();
    let leases = Leases::machine().unwrap();
    for port in ports {
        assert_eq!(leases.holder(port).unwrap(), Some(me), "port {port}");
    }
}

#[test]
fn a_cluster_for_an_owner_that_does_not_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let out = Command::new(script())
        .args(["prepare", "--nodes", "1", "--dir"])
        .arg(dir.path())
        .env("IDEM_PORTS_OWNER", pid.to_string())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("the ports' owner, process {pid}, does not run")),
        "{stderr}"
    );
}

//! A local three-master Redis Cluster for tests: three `redis-server --cluster-enabled yes`
//! processes on free ports in a temp dir, joined with `redis-cli --cluster create`, ready once
//! every node reports `cluster_state:ok`. Killed when dropped. Skipped outside CI when
//! `redis-server` or `redis-cli` is missing; a failure under `CI=true`.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agentd::store::redis::{RedisConfig, RedisStore};

use crate::redis_support::{eventually, skip_or_fail, unique_ns};

/// How long the cluster may take to form.
const FORM_WITHIN: Duration = Duration::from_secs(30);

pub struct LocalCluster {
    nodes: Vec<Option<Child>>,
    ports: Vec<u16>,
    dir: tempfile::TempDir,
}

/// A free port whose cluster bus port (+10000) is free too.
fn free_port_pair(taken: &[u16]) -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        if port > 55_000 || taken.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn redis_cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

impl LocalCluster {
    /// Starts and forms the cluster, or `None` (skip outside CI) when the Redis tools are
    /// missing.
    pub async fn start() -> Option<Self> {
        for tool in ["redis-server", "redis-cli"] {
            if Command::new(tool)
                .arg("--version")
                .stdout(Stdio::null())
                .status()
                .is_err()
            {
                skip_or_fail(&format!("{tool} is not installed: no local Redis Cluster"));
                return None;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let mut ports = Vec::new();
        for _ in 0..3 {
            ports.push(free_port_pair(&ports));
        }
        let mut me = LocalCluster {
            nodes: Vec::new(),
            ports,
            dir,
        };
        for i in 0..3 {
            let child = me.spawn(i);
            me.nodes.push(Some(child));
        }
        for &p in &me.ports {
            eventually(
                "a cluster node to answer",
                Duration::from_secs(10),
                || async move { redis_cli(p, &["ping"]).filter(|o| o.contains("PONG")) },
            )
            .await;
        }
        let addrs: Vec<String> = me.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let create = tokio::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .arg("--cluster-yes")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let status = tokio::time::timeout(FORM_WITHIN, create)
            .await
            .expect("redis-cli --cluster create did not finish")
            .unwrap();
        assert!(status.success(), "redis-cli --cluster create failed");
        me.wait_ok().await;
        Some(me)
    }

    fn spawn(&self, i: usize) -> Child {
        let port = self.ports[i];
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes"])
            .arg("--cluster-config-file")
            .arg(self.dir.path().join(format!("nodes-{port}.conf")))
            .args(["--cluster-node-timeout", "2000"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }

    /// Waits until every running node reports `cluster_state:ok`.
    pub async fn wait_ok(&self) {
        let ports: Vec<u16> = self
            .ports
            .iter()
            .zip(&self.nodes)
            .filter(|(_, c)| c.is_some())
            .map(|(p, _)| *p)
            .collect();
        eventually("cluster_state:ok on every node", FORM_WITHIN, || {
            let ports = ports.clone();
            async move {
                ports
                    .iter()
                    .all(|&p| {
                        redis_cli(p, &["cluster", "info"])
                            .is_some_and(|o| o.contains("cluster_state:ok"))
                    })
                    .then_some(())
            }
        })
        .await;
    }

    /// SIGKILLs node `i` and waits for it to exit.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts node `i` again on its port and cluster config file (it keeps its slots, and
    /// comes back without data: no persistence) and waits for `cluster_state:ok`.
    pub async fn restart(&mut self, i: usize) {
        self.kill(i);
        let child = self.spawn(i);
        self.nodes[i] = Some(child);
        self.wait_ok().await;
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// A store on this cluster with a fresh namespace.
    pub async fn store(&self, cfg: impl FnOnce(RedisConfig) -> RedisConfig) -> RedisStore {
        let config = cfg(RedisConfig::new(self.url())
            .namespace(unique_ns())
            .op_timeout(Duration::from_secs(5)));
        RedisStore::open(config).await.unwrap()
    }

    /// `redis-cli` against node `i`, e.g. `INFO commandstats`.
    pub fn cli(&self, i: usize, args: &[&str]) -> Option<String> {
        redis_cli(self.ports[i], args)
    }

    /// Sums a command's `calls=` over every master's `INFO commandstats` (e.g. `evalsha`).
    pub fn command_calls(&self, command: &str) -> u64 {
        (0..self.ports.len())
            .filter_map(|i| self.cli(i, &["info", "commandstats"]))
            .map(|info| commandstats_calls(&info, command))
            .sum()
    }
}

/// `calls=` of `cmdstat_<command>` in an `INFO commandstats` answer (0 if absent).
pub fn commandstats_calls(info: &str, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:");
    info.lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').find_map(|kv| kv.strip_prefix("calls=")))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for c in self.nodes.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

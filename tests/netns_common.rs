//! Two "nodes" on one machine, as `multimodal-multinode.md` B8 describes: two network
//! namespaces joined only by a veth pair (10.213.7.1 and .2, no route anywhere else), the
//! follower in its own mount namespace with a private `/dev/shm` and its own PID namespace, so
//! it can neither attach the leader's rings nor see its processes. The leader's name resolves
//! on the follower through `/etc/netns/<ns>/hosts`, as a LeaderWorkerSet's DNS name would.
//! Everything is removed when the pair is dropped.

#![allow(dead_code)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub const LEADER_IP: &str = "10.213.7.1";
pub const FOLLOWER_IP: &str = "10.213.7.2";
/// The leader's name on the follower (a LeaderWorkerSet's `$(LWS_LEADER_ADDRESS)`).
pub const LEADER_NAME: &str = "omni-0.omni.default";

static SEQ: AtomicU32 = AtomicU32::new(0);

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn must(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The two namespaces of one test.
pub struct NodePair {
    pub leader_ns: String,
    pub follower_ns: String,
    pub dir: PathBuf,
}

impl NodePair {
    /// Creates the pair, or `None` (after printing why) where namespaces cannot be made: not
    /// root, or no `ip`/`unshare`.
    pub fn new() -> Option<Self> {
        let root = nix::unistd::Uid::effective().is_root();
        if !root || !sh(&["ip", "-V"]) || !sh(&["unshare", "--version"]) {
            eprintln!("SKIP: network namespaces need root, ip and unshare");
            return None;
        }
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}{n}", std::process::id());
        let pair = Self {
            leader_ns: format!("omni_a{tag}"),
            follower_ns: format!("omni_b{tag}"),
            dir: std::env::temp_dir().join(format!("omni-multinode-{tag}")),
        };
        std::fs::create_dir_all(&pair.dir).unwrap();
        let (va, vb) = (format!("oa{tag}"), format!("ob{tag}"));
        let (a, b) = (pair.leader_ns.as_str(), pair.follower_ns.as_str());
        must(&["ip", "netns", "add", a]);
        must(&["ip", "netns", "add", b]);
        must(&[
            "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
        ]);
        must(&["ip", "link", "set", &va, "netns", a]);
        must(&["ip", "link", "set", &vb, "netns", b]);
        must(&[
            "ip",
            "-n",
            a,
            "addr",
            "add",
            &format!("{LEADER_IP}/30"),
            "dev",
            &va,
        ]);
        must(&[
            "ip",
            "-n",
            b,
            "addr",
            "add",
            &format!("{FOLLOWER_IP}/30"),
            "dev",
            &vb,
        ]);
        for (ns, dev) in [(a, &va), (b, &vb)] {
            must(&["ip", "-n", ns, "link", "set", "lo", "up"]);
            must(&["ip", "-n", ns, "link", "set", dev, "up"]);
        }
        let etc = PathBuf::from("/etc/netns").join(b);
        std::fs::create_dir_all(&etc).unwrap();
        let hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
        std::fs::write(
            etc.join("hosts"),
            format!("{hosts}\n{LEADER_IP} {LEADER_NAME}\n"),
        )
        .unwrap();
        Some(pair)
    }

    /// Limits both ends of the link to `rate` (e.g. `10gbit`) with a token bucket.
    pub fn set_rate(&self, rate: &str) {
        for ns in [&self.leader_ns, &self.follower_ns] {
            let dev = self.dev_of(ns);
            must(&[
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", &dev, "root", "tbf",
                "rate", rate, "burst", "1mb", "latency", "50ms",
            ]);
        }
    }

    fn dev_of(&self, ns: &str) -> String {
        let tag = ns.trim_start_matches("omni_a").trim_start_matches("omni_b");
        if ns == self.leader_ns {
            format!("oa{tag}")
        } else {
            format!("ob{tag}")
        }
    }

    /// `bin args...` in the leader's namespace (the root's `/dev/shm`), stdout to
    /// `<dir>/leader.out`, stderr to `<dir>/leader.log`.
    pub fn spawn_leader(&self, bin: &Path, args: &[String]) -> Child {
        let out = std::fs::File::create(self.dir.join("leader.out")).unwrap();
        let log = std::fs::File::create(self.dir.join("leader.log")).unwrap();
        Command::new("ip")
            .args(["netns", "exec", &self.leader_ns])
            .arg(bin)
            .args(args)
            .env("RUST_LOG", "info")
            .env("RUST_BACKTRACE", "0")
            .stdout(out)
            .stderr(log)
            .spawn()
            .unwrap()
    }

    /// `bin args...` in the follower's namespaces with a private `/dev/shm` (whose listing
    /// after the binary exits goes to `<dir>/follower-shm.txt`), output to
    /// `<dir>/follower.log`.
    pub fn spawn_follower(&self, bin: &Path, args: &[String]) -> Child {
        let log = std::fs::File::create(self.dir.join("follower.log")).unwrap();
        let script = "mount -t tmpfs -o size=512m tmpfs /dev/shm || exit 90; \"$@\"; rc=$?; \
                      ls -A /dev/shm > \"$OMNI_SHM_LIST\"; exit $rc";
        Command::new("ip")
            .args(["netns", "exec", &self.follower_ns])
            .args([
                "unshare",
                "--mount",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
            ])
            .args(["sh", "-c", script, "sh"])
            .arg(bin)
            .args(args)
            .env("OMNI_SHM_LIST", self.dir.join("follower-shm.txt"))
            .env("RUST_LOG", "info")
            .env("RUST_BACKTRACE", "0")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    /// What the follower's `/dev/shm` held after its binary exited.
    pub fn follower_shm(&self) -> String {
        std::fs::read_to_string(self.dir.join("follower-shm.txt"))
            .unwrap_or_else(|e| format!("<no listing: {e}>"))
    }

    /// A log of this pair (`leader` or `follower`).
    pub fn log(&self, who: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{who}.log"))).unwrap_or_default()
    }

    /// The leader's stdout.
    pub fn leader_stdout(&self) -> String {
        std::fs::read_to_string(self.dir.join("leader.out")).unwrap_or_default()
    }

    /// Pids (as the root namespace sees them) of processes named `comm` in the follower's
    /// network namespace.
    pub fn follower_pids(&self, comm: &str) -> Vec<i32> {
        let ns = std::fs::metadata(format!("/run/netns/{}", self.follower_ns))
            .map(|m| m.ino())
            .unwrap_or(0);
        let mut pids = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let in_ns =
                std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == ns);
            if name.trim() == comm && in_ns {
                pids.push(pid);
            }
        }
        pids
    }

    /// Starts `f` on a thread that has entered the leader's network namespace (so it can
    /// reach the leader's HTTP port).
    pub fn in_leader_ns<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/run/netns/{}", self.leader_ns);
        std::thread::spawn(move || {
            let fd = std::fs::File::open(&path).unwrap();
            nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
    }
}

impl Drop for NodePair {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.leader_ns]);
        let _ = sh(&["ip", "netns", "del", &self.follower_ns]);
        let _ = std::fs::remove_dir_all(PathBuf::from("/etc/netns").join(&self.follower_ns));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One HTTP/1.1 request (`Connection: close`) to `addr`; returns the status line and the whole
/// response text (headers and body), read until the server closes, at most `limit`.
pub fn http(addr: &str, method: &str, path: &str, body: &str, limit: Duration) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(limit)).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut text = Vec::new();
    let _ = s.read_to_end(&mut text);
    let text = String::from_utf8_lossy(&text).into_owned();
    let status = text.lines().next().unwrap_or("").to_string();
    (status, text)
}

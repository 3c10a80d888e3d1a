//! `cargo xtask demo`: three HTTP backends on loopback, the daemon with the
//! VIP 127.0.0.1:6444 in front of them, attached to a throwaway cgroup
//! `lb-demo`. Everything is removed on exit, also after Ctrl-C.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{Shutdown, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU8, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::cmd::{is_root, lb_bin, target_dir};

const VIP: &str = "127.0.0.1:6444";
const BACKENDS: [&str; 3] = ["127.0.0.1:16441", "127.0.0.1:16442", "127.0.0.1:16443"];

/// What the demo set up; dropping it takes everything down again.
struct Demo {
    dir: PathBuf,
    config: PathBuf,
    cgroup: PathBuf,
    daemon: Option<Child>,
    stop_backends: Arc<AtomicBool>,
}

pub fn run(exit_after: u64) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "the demo attaches eBPF programs to a cgroup and needs root: run `sudo -E cargo xtask demo`"
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // Ctrl-C only sets the flag; the loop below cleans up.
        let _ = ctrlc::set_handler(move || stop.store(true, Ordering::Relaxed));
    }

    let dir = target_dir().join("demo");
    std::fs::create_dir_all(&dir)?;
    let cgroup = lb_tests::cgroup2_root().context("the demo needs cgroup v2")?.join("lb-demo");
    let config = dir.join("config.toml");
    let mut demo = Demo {
        dir: dir.clone(),
        config: config.clone(),
        cgroup: cgroup.clone(),
        daemon: None,
        stop_backends: Arc::new(AtomicBool::new(false)),
    };

    let modes: Vec<Arc<AtomicU8>> =
        BACKENDS.iter().map(|_| Arc::new(AtomicU8::new(RUNNING))).collect();
    for (i, addr) in BACKENDS.iter().enumerate() {
        start_backend(
            &format!("backend-{}", i + 1),
            addr,
            modes[i].clone(),
            demo.stop_backends.clone(),
        )?;
    }
    if !cgroup.exists() {
        std::fs::create_dir(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
    }
    let servers: Vec<String> = BACKENDS.iter().map(|b| format!("\"{b}\"")).collect();
    std::fs::write(
        &config,
        format!(
            "# Written by `cargo xtask demo`.\n[daemon]\ncgroup = {cgroup:?}\nbpffs = \"/sys/fs/bpf/lb-demo\"\ncontrol_socket = {:?}\n\n\
             [[service]]\nname = \"demo\"\nvip = \"{VIP}\"\nservers = [{}]\nhold_down = \"2s\"\n\n\
             [service.health]\ncheck = \"http\"\npath = \"/healthz\"\ninterval = \"1s\"\ntimeout = \"500ms\"\n",
            dir.join("lb.sock"),
            servers.join(", ")
        ),
    )?;
    let log = std::fs::File::create(dir.join("lb.log"))?;
    demo.daemon = Some(
        Command::new(lb_bin())
            .args(["run", "--config"])
            .arg(&config)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting lb run")?,
    );
    wait_for_daemon(&mut demo)?;

    let lb = lb_bin();
    let help = format!(
        "lb: VIP {VIP} -> {}, no proxy: programs in the cgroup {} connect to the VIP and\n\
         land on a backend directly. Below: `lb status`, and one request through the VIP, every 2 s.\n\
         Type a key and Enter:  k1 kill backend-1 (refuse)   h1 hang it (accept nothing)   r1 restore it   q quit\n\
         Try in another terminal:\n\
         \x20 sudo bash -c 'echo $$ > {}/cgroup.procs; exec bash'   # a shell inside the cgroup, then:\n\
         \x20 curl http://{VIP}/\n\
         \x20 {} status --watch --config {}\n\
         Log: {}",
        BACKENDS.join(", "),
        cgroup.display(),
        cgroup.display(),
        lb.display(),
        config.display(),
        dir.join("lb.log").display(),
    );
    println!("\n{help}\n");

    let keys = read_keys();
    let started = Instant::now();
    let mut next = Instant::now();
    let mut last_event = String::new();
    while !stop.load(Ordering::Relaxed) {
        if exit_after > 0 && started.elapsed() >= Duration::from_secs(exit_after) {
            break;
        }
        while let Ok(key) = keys.try_recv() {
            let key = key.trim();
            let (action, n) = key.split_at(key.len().min(1));
            let backend = n.parse::<usize>().ok().filter(|n| (1..=BACKENDS.len()).contains(n));
            last_event = match (action, backend) {
                ("q", _) => {
                    stop.store(true, Ordering::Relaxed);
                    "quitting".to_owned()
                }
                ("k", Some(n)) => {
                    modes[n - 1].store(KILLED, Ordering::Relaxed);
                    format!("killed backend-{n}: its port now refuses connects")
                }
                ("h", Some(n)) => {
                    modes[n - 1].store(HUNG, Ordering::Relaxed);
                    format!("hung backend-{n}: its port accepts nothing")
                }
                ("r", Some(n)) => {
                    modes[n - 1].store(RUNNING, Ordering::Relaxed);
                    format!("restored backend-{n}")
                }
                _ => format!("unknown key {key:?}: k1..k3, h1..h3, r1..r3, q"),
            };
            next = Instant::now();
        }
        if Instant::now() >= next {
            let status = Command::new(&lb).args(["status", "--config"]).arg(&config).output()?;
            let answer = get_in_cgroup(&cgroup, VIP)?;
            if exit_after == 0 && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                print!("\x1b[2J\x1b[H{help}\n\n");
            }
            print!("{}", String::from_utf8_lossy(&status.stdout));
            println!("GET http://{VIP}/ -> {answer}");
            if !last_event.is_empty() {
                println!("last action: {last_event}");
            }
            if exit_after > 0 && !answer.starts_with("backend-") {
                bail!("the demo request through the VIP was not answered by a backend: {answer}");
            }
            next = Instant::now() + Duration::from_secs(2);
        }
        thread::sleep(Duration::from_millis(100));
    }
    println!("\nstopping: detaching lb and removing the demo cgroup");
    drop(demo);
    Ok(())
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
        let _ = Command::new(lb_bin())
            .args(["detach", "--config"])
            .arg(&self.config)
            .stdout(Stdio::null())
            .status();
        self.stop_backends.store(true, Ordering::Relaxed);
        let _ = std::fs::write(self.cgroup.join("cgroup.kill"), "1");
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_file(self.dir.join("lb.sock"));
    }
}

fn wait_for_daemon(demo: &mut Demo) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = demo.daemon.as_mut().and_then(|d| d.try_wait().ok().flatten()) {
            let log = std::fs::read_to_string(demo.dir.join("lb.log")).unwrap_or_default();
            bail!("lb run exited with {status}:\n{log}");
        }
        let ok = Command::new(lb_bin())
            .args(["status", "--config"])
            .arg(&demo.config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("lb run did not come up within 60 s; see {}", demo.dir.join("lb.log").display());
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// What a demo backend does now (changed by the keys the demo reads).
const RUNNING: u8 = 0;
const HUNG: u8 = 1;
const KILLED: u8 = 2;

/// A demo backend: answers HTTP with its name while running; when hung it
/// keeps its port but accepts nothing (connects and checks time out);
/// when killed its port is closed (connects are refused).
fn start_backend(
    name: &str,
    addr: &str,
    mode: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut listener = Some(bind(name, addr)?);
    let (name, addr) = (name.to_owned(), addr.to_owned());
    let body = format!("{name} ({addr})\n");
    thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match mode.load(Ordering::Relaxed) {
                KILLED => {
                    listener = None;
                    thread::sleep(Duration::from_millis(50));
                    continue;
                }
                _ if listener.is_none() => listener = bind(&name, &addr).ok(),
                _ => {}
            }
            let Some(l) = &listener else { continue };
            if mode.load(Ordering::Relaxed) == HUNG {
                thread::sleep(Duration::from_millis(50));
                continue;
            }
            match l.accept() {
                Ok((stream, _)) => answer(stream, &body),
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    Ok(())
}

/// The most a demo backend reads of one request's head.
const MAX_REQUEST: usize = 8 * 1024;
/// How long a demo backend waits for a whole request.
const REQUEST_TIME: Duration = Duration::from_secs(2);
/// How long a demo backend waits, after its answer, for the client to close.
const DRAIN_TIME: Duration = Duration::from_millis(500);

/// Serves one connection of a demo backend: reads the whole request (its
/// head, to the blank line; a GET has no body), answers in one write, then
/// closes its sending side and reads until the client closes. Closing with
/// part of a request unread would make the kernel reset the connection,
/// and the client could see "broken pipe" or "connection reset" instead of
/// the answer. A connection that sends no whole request (a TCP health
/// check, a client that gives up) is closed without an answer.
fn answer(mut stream: TcpStream, body: &str) {
    let _ = stream.set_nonblocking(false);
    if read_request(&mut stream).is_err() {
        return;
    }
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if stream.write_all(response.as_bytes()).is_err() {
        return;
    }
    let _ = stream.shutdown(Shutdown::Write);
    drain(&mut stream);
}

/// Reads a request's head, up to and with the blank line that ends it (at
/// most [`MAX_REQUEST`] bytes, within [`REQUEST_TIME`]).
fn read_request(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let deadline = Instant::now() + REQUEST_TIME;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_REQUEST {
            return Err(ErrorKind::InvalidData.into());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf)? {
            0 => return Err(ErrorKind::UnexpectedEof.into()),
            n => head.extend_from_slice(&buf[..n]),
        }
    }
    Ok(head)
}

/// Reads and drops whatever the client still sends until it closes (at
/// most [`DRAIN_TIME`]), so that closing the socket sends no reset.
fn drain(stream: &mut TcpStream) {
    let deadline = Instant::now() + DRAIN_TIME;
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn bind(name: &str, addr: &str) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(addr)
        .with_context(|| format!("{name}: binding {addr} (is a demo already running?)"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Lines typed on stdin, as they come (none when stdin is closed).
fn read_keys() -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// Runs `xtask demo-get ADDR` inside `cgroup` and returns what it printed.
fn get_in_cgroup(cgroup: &Path, addr: &str) -> anyhow::Result<String> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["demo-get", addr]);
    lb_tests::start_in_cgroup(&mut cmd, cgroup);
    let out = cmd.output()?;
    Ok(String::from_utf8_lossy(if out.status.success() { &out.stdout } else { &out.stderr })
        .trim()
        .to_owned())
}

/// One HTTP GET; prints the body.
pub fn get(addr: &str) -> anyhow::Result<()> {
    let target = addr.parse().with_context(|| format!("bad address {addr}"))?;
    let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))
        .with_context(|| format!("connect {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    // The whole request in one write: the backend answers once it has read
    // the blank line that ends it.
    let request = format!("GET / HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .with_context(|| format!("sending the request to {addr}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .with_context(|| format!("reading the answer from {addr}"))?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    print!("{body}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request that arrives in pieces is read whole before the answer,
    /// and the answer ends with a close, not a reset.
    #[test]
    fn a_backend_reads_the_whole_request_before_it_answers() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            answer(stream, "b1\n");
        });
        let mut client = TcpStream::connect(addr).unwrap();
        client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        client.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
        thread::sleep(Duration::from_millis(100));
        client.write_all(b"Connection: close\r\n\r\n").unwrap();
        let mut response = String::new();
        client.read_to_string(&mut response).unwrap();
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.ends_with("\r\n\r\nb1\n"), "{response}");
        drop(client);
        server.join().unwrap();
    }

    /// A connection that sends no whole request gets no answer.
    #[test]
    fn a_backend_closes_a_connection_without_a_request() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            answer(stream, "b1\n");
        });
        let mut client = TcpStream::connect(addr).unwrap();
        client.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let mut response = String::new();
        client.read_to_string(&mut response).unwrap();
        assert_eq!(response, "");
        server.join().unwrap();
    }
}

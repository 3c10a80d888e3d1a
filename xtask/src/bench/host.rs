//! What the bench asks of this machine: a process's CPU time and memory,
//! CPU affinity (and the one CPU of the paths part), this process's cgroup,
//! free ports.

use std::{
    net::SocketAddr, os::unix::process::CommandExt as _, path::PathBuf, process::Command,
    time::Duration,
};

use anyhow::Context as _;

/// User + system CPU time of process `pid` so far (all its threads).
pub fn cpu_time(pid: i32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After "pid (comm) ": state is field 3; utime and stime are 14 and 15.
    let fields: Vec<&str> = stat
        .rsplit_once(") ")
        .context("/proc/PID/stat without a comm")?
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// Resident memory of process `pid` (VmRSS), in bytes.
pub fn rss(pid: i32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line =
        status.lines().find(|l| l.starts_with("VmRSS:")).context("no VmRSS in /proc/PID/status")?;
    let kb: u64 = line.split_whitespace().nth(1).context("VmRSS without a value")?.parse()?;
    Ok(kb * 1024)
}

/// The cgroup (v2) this process is in: where the bench's own agents start.
pub fn own_cgroup() -> anyhow::Result<PathBuf> {
    let line = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let relative = line
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("this process is in no cgroup v2 (no 0:: line in /proc/self/cgroup)")?;
    let root = lb_tests::cgroup2_root().context("finding the cgroup2 mount")?;
    Ok(root.join(relative.trim_start_matches('/')))
}

/// The CPUs the calling thread may run on.
pub fn affinity() -> std::io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; the kernel fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 is this thread.
    if unsafe { libc::sched_getaffinity(0, size_of_val(&set), &raw mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET reads the set; every index is below its size.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Lets the calling thread run only on `cpus`. Async-signal-safe (no
/// allocation): [`start_on_cpu`] calls it between fork and exec.
pub fn set_affinity(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: as in `affinity`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // CPU_SET would index out of the set (and panic) beyond its size.
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `cpu` is within the set, checked above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 is this thread.
    if unsafe { libc::sched_setaffinity(0, size_of_val(&set), &raw const set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `cmd` start on `cpu` only (its threads and children inherit it).
pub fn start_on_cpu(cmd: &mut Command, cpu: usize) {
    // SAFETY: between fork and exec only `set_affinity`, which is
    // async-signal-safe.
    unsafe { cmd.pre_exec(move || set_affinity(&[cpu])) };
}

/// The one CPU on which the paths part runs: its clients (the agent and
/// wrk), the origins and the proxies. The last one this process may use.
///
/// Why one: a request or a connect wakes the server and then the client.
/// Left to the scheduler, the two share a CPU after a pause and are spread
/// over both CPUs after some 20 ms of running; a connect + close loop then
/// ran at 55,000/s or at 13,000/s on the development VM (in the second
/// case most of each connect is the wake-up of a halted virtual CPU, which
/// the host does, and the CPUs are 60 % idle), and wrk keep-alive read
/// anything from 0.82 to 1.26 × direct through a VIP that runs no code per
/// request. Which case a run got depended on what came before it (a
/// pause, the agent's move between cgroups), so a ratio measured the
/// scheduler. On one CPU every run does all of its work itself: a rate is
/// the CPU time that a request, a connect or a byte costs, which is what
/// lb (or a proxy) adds to.
pub fn paths_cpu() -> anyhow::Result<usize> {
    affinity().context("reading this process's CPU affinity")?.last().copied().context("no CPU")
}

/// A free TCP port on `ip` (bound, then released: the caller binds it
/// again soon after).
pub fn free_port(ip: [u8; 4]) -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind(SocketAddr::from((ip, 0)))
        .with_context(|| format!("binding a port on {ip:?}"))?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use std::thread;

    use super::*;

    /// A thread pinned to [`paths_cpu`] runs there alone, and is let go
    /// to every CPU again.
    #[test]
    fn a_thread_pins_to_the_paths_cpu_and_back() {
        thread::spawn(|| {
            let all = affinity().unwrap();
            let cpu = paths_cpu().unwrap();
            assert_eq!(all.last(), Some(&cpu));
            set_affinity(&[cpu]).unwrap();
            assert_eq!(affinity().unwrap(), [cpu]);
            set_affinity(&all).unwrap();
            assert_eq!(affinity().unwrap(), all);
            // A CPU beyond what a set can hold is an error, not a panic.
            assert!(set_affinity(&[1 << 20]).is_err());
        })
        .join()
        .unwrap();
    }
}

//! `lb_xdp` loaded once per test process and lent to one case at a time,
//! its maps emptied before each. The verifier takes seconds over the
//! program (minutes in a guest under software emulation), so loading it
//! for every case and family was most of what the fixtures cost; a case
//! only needs maps as a fresh load leaves them.
//!
//! A program is not tied to a network namespace: under
//! `BPF_PROG_TEST_RUN` it asks the FIB of the namespace of the thread that
//! runs it, so each case still builds its own topology. `test_run` runs,
//! and `time_run` times, any XDP program so (the benchmark's too).

use std::{
    ops::{Deref, DerefMut},
    os::fd::{AsFd as _, AsRawFd as _},
    sync::{Mutex, MutexGuard, PoisonError},
};

use aya::{
    Ebpf,
    maps::{Map, MapData},
    programs::{TestRun as _, TestRunOptions, Xdp},
};

/// The program of this process, once loaded.
static PROGRAM: Mutex<Option<Ebpf>> = Mutex::new(None);

/// `lb_xdp` with empty maps, for one case: the next case waits until
/// this one is dropped.
pub struct Lent {
    guard: MutexGuard<'static, Option<Ebpf>>,
}

impl Lent {
    /// Loads the program if this process has not yet, waits for the case
    /// before to give it back, and empties its maps.
    pub fn take() -> Self {
        // A case that failed still gave the program back; its maps are
        // emptied here all the same.
        let mut guard = PROGRAM.lock().unwrap_or_else(PoisonError::into_inner);
        let ebpf = guard.get_or_insert_with(|| {
            lb_user::datapath::xdp::load_unattached_with(Some(super::OPENING_FLOWS))
                .expect("loading the XDP program")
        });
        for (name, map) in ebpf.maps_mut() {
            empty(name, map);
        }
        Self { guard }
    }
}

impl Deref for Lent {
    type Target = Ebpf;

    fn deref(&self) -> &Ebpf {
        self.guard.as_ref().expect("loaded in Lent::take")
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut Ebpf {
        self.guard.as_mut().expect("loaded in Lent::take")
    }
}

/// Empties `map` as a fresh load leaves it: a hash map without entries,
/// an array of zeros. The object's global data (`.rodata`, `.bss`: set at
/// load) and the ring buffer (the fixtures never read it) stay.
fn empty(name: &str, map: &mut Map) {
    if name.starts_with('.') {
        return;
    }
    match map {
        Map::HashMap(data)
        | Map::LruHashMap(data)
        | Map::PerCpuHashMap(data)
        | Map::PerCpuLruHashMap(data) => delete_all(name, data),
        Map::Array(data) => zero_all(name, data, 1),
        Map::PerCpuArray(data) => zero_all(name, data, aya::util::nr_cpus().expect("CPUs")),
        Map::RingBuf(_) => {}
        _ => panic!("map {name}: a kind the fixtures do not know how to empty"),
    }
}

/// `union bpf_attr` as the map element commands read it.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value_or_next_key: u64,
    flags: u64,
}

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

/// One `bpf(2)` call on a map element.
fn bpf(cmd: libc::c_long, attr: &ElemAttr) -> std::io::Result<()> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix for `cmd`, its pointers
    // point at buffers of the map's key and value sizes, and the kernel
    // reads no further than the size given.
    let done = unsafe {
        libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_ref(attr), size_of::<ElemAttr>())
    };
    if done < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Writes `value` at `key` in the hash map `map`, through a shared
/// borrow of it (between program runs, the kernel's map is all there is).
pub(super) fn update<K, V>(map: &Map, key: &K, value: &V) {
    let (Map::HashMap(data) | Map::LruHashMap(data)) = map else {
        panic!("update: not a hash map");
    };
    let update = ElemAttr {
        map_fd: data.fd().as_fd().as_raw_fd() as u32,
        key: std::ptr::from_ref(key) as u64,
        value_or_next_key: std::ptr::from_ref(value) as u64,
        ..ElemAttr::default()
    };
    bpf(BPF_MAP_UPDATE_ELEM, &update).unwrap_or_else(|e| panic!("update: {e}"));
}

/// Deletes every entry of a hash map: the first key, again and again.
fn delete_all(name: &str, data: &MapData) {
    let info = data.info().unwrap_or_else(|e| panic!("map {name}: {e}"));
    let fd = data.fd().as_fd().as_raw_fd() as u32;
    let mut key = vec![0u8; info.key_size() as usize];
    // Each round deletes one entry: bounded by the map's size.
    for _ in 0..=info.max_entries() {
        let first = ElemAttr {
            map_fd: fd,
            value_or_next_key: key.as_mut_ptr() as u64,
            ..ElemAttr::default()
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &first) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return,
            Err(e) => panic!("map {name}: the first key: {e}"),
        }
        let delete = ElemAttr { map_fd: fd, key: key.as_ptr() as u64, ..ElemAttr::default() };
        bpf(BPF_MAP_DELETE_ELEM, &delete).unwrap_or_else(|e| panic!("map {name}: delete: {e}"));
    }
    panic!("map {name}: still not empty after {} deletes", info.max_entries() + 1);
}

/// Writes zeros to every slot of an array, on each of `cpus` CPUs.
fn zero_all(name: &str, data: &MapData, cpus: usize) {
    let info = data.info().unwrap_or_else(|e| panic!("map {name}: {e}"));
    let fd = data.fd().as_fd().as_raw_fd() as u32;
    // A per-CPU value is the value rounded up to 8 bytes, once per CPU.
    let size = if cpus == 1 {
        info.value_size() as usize
    } else {
        (info.value_size() as usize).next_multiple_of(8) * cpus
    };
    let zeros = vec![0u8; size];
    for index in 0..info.max_entries() {
        let update = ElemAttr {
            map_fd: fd,
            key: std::ptr::from_ref(&index) as u64,
            value_or_next_key: zeros.as_ptr() as u64,
            flags: 0,
            _pad: 0,
        };
        bpf(BPF_MAP_UPDATE_ELEM, &update).unwrap_or_else(|e| panic!("map {name}[{index}]: {e}"));
    }
}

/// What one `BPF_PROG_TEST_RUN` of an XDP program gave.
pub struct Ran {
    /// The program's verdict (`XDP_*`).
    pub verdict: u32,
    /// The frame as the program left it.
    pub frame: Vec<u8>,
    /// The kernel's measure of one run: the average over the repeats.
    pub duration: std::time::Duration,
}

/// Runs `program` on `frame` arriving on `ingress` (loopback when `None`;
/// an input `xdp_md` needs Linux 5.14), `repeat` times on one buffer:
/// each repeat sees what the runs before it left of the frame.
pub fn test_run(
    program: &Xdp,
    frame: &[u8],
    repeat: u32,
    ingress: Option<u32>,
) -> Result<Ran, aya::programs::ProgramError> {
    let mut out = vec![0u8; frame.len() + 512];
    // `struct xdp_md`: data, data_end, data_meta, ingress_ifindex,
    // rx_queue_index, egress_ifindex.
    let ctx: Vec<u8> = [0, frame.len() as u32, 0, ingress.unwrap_or(0), 0, 0]
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .collect();
    let result = program.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        ctx_in: ingress.map(|_| ctx.as_slice()),
        repeat,
        ..TestRunOptions::default()
    })?;
    out.truncate(result.data_size_out as usize);
    Ok(Ran { verdict: result.return_value, frame: out, duration: result.duration })
}

/// An XDP program's time per run on `frame` arriving on `ingress`, run
/// `repeat` times on one buffer ([`test_run`]).
pub fn time_run(
    program: &Xdp,
    frame: &[u8],
    repeat: u32,
    ingress: Option<u32>,
) -> std::time::Duration {
    test_run(program, frame, repeat, ingress).expect("BPF_PROG_TEST_RUN").duration
}

//! NCCL through cudarc, in non-blocking mode: every call returns at once and is then waited on
//! against a deadline, so a peer that never joins, or a step the ranks do not agree on, ends in
//! [`EpError::Timeout`] (and an aborted communicator), not a hang.

use super::EpError;
use crate::device::Device;
use cudarc::driver::{sys as cu, CudaContext, CudaStream};
use cudarc::nccl::sys;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An NCCL unique id: made once (by rank 0, or a launcher) and handed to every rank, e.g. as
/// the hex string of [`UniqueId::to_hex`] in an environment variable.
#[derive(Clone, Copy)]
pub struct UniqueId([u8; 128]);

impl UniqueId {
    /// A fresh id (NCCL picks the bootstrap address: this host's network interface).
    pub fn new() -> Result<UniqueId, EpError> {
        nccl_present()?;
        let id = cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e.0))?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// 256 hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The id [`UniqueId::to_hex`] wrote.
    pub fn from_hex(s: &str) -> Result<UniqueId, EpError> {
        let bad = || EpError::Config(format!("an NCCL unique id is 256 hex digits, got {:?}", s));
        if s.len() != 256 || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 128];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(UniqueId(out))
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

fn nccl_present() -> Result<(), EpError> {
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(EpError::NcclMissing)
    }
}

fn nccl_err(call: &'static str, code: sys::ncclResult_t) -> EpError {
    EpError::Nccl { call, code: format!("{code:?}") }
}

/// One rank's NCCL communicator, non-blocking, with the deadline its waits use.
pub struct Comm {
    raw: sys::ncclComm_t,
    rank: usize,
    ranks: usize,
    ctx: Arc<CudaContext>,
    timeout: Duration,
    aborted: AtomicBool,
}

// An NCCL communicator may be used from any thread, one call at a time (`&mut` or the layer).
unsafe impl Send for Comm {}

/// `NCCL_WIN_COLL_SYMMETRIC` (nccl.h): every rank passes the same offsets into the window.
const WIN_COLL_SYMMETRIC: i32 = 0x01;
/// `NCCL_CTA_POLICY_ZERO` (nccl.h, 2.28): collectives that can run on the copy engines do (today
/// all-to-all, scatter, gather and all-gather between symmetric windows within one node); every
/// other call is as under the default policy.
const CTA_POLICY_ZERO: i32 = 0x02;

/// Device memory from `ncclMemAlloc`, registered with a communicator as a symmetric window, so
/// that an all-to-all between two of them can run on the copy engines. Freed on drop; its
/// registration goes with the communicator (which is aborted, never destroyed: see
/// [`Comm`]'s drop), so it must outlive the [`Comm`] only in memory, not in use.
pub(crate) struct Window {
    ptr: u64,
    bytes: usize,
    /// Null where NCCL registered nothing: no symmetric memory here (no direct peer access, or
    /// `NCCL_WIN_ENABLE=0`); transfers from it then run on NCCL's kernels.
    win: sys::ncclWindow_t,
}

// The window is device memory and a handle NCCL owns; nothing in it is tied to a thread.
unsafe impl Send for Window {}

impl Window {
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
    /// Whether NCCL registered it (a copy-engine all-to-all is possible).
    pub(crate) fn registered(&self) -> bool {
        !self.win.is_null()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        unsafe { sys::ncclMemFree(self.ptr as *mut _) };
    }
}

/// One point-to-point transfer of a group.
#[derive(Clone, Copy, Debug)]
pub(crate) enum P2p {
    Send { ptr: u64, bytes: usize, peer: usize },
    Recv { ptr: u64, bytes: usize, peer: usize },
}

impl Comm {
    /// Join the communicator of `ranks` ranks named by `id` as `rank`, on `device`. Every rank
    /// calls this with the same id; `timeout` bounds this call and every later wait.
    pub fn new(device: &Device, rank: usize, ranks: usize, id: &UniqueId, timeout: Duration) -> Result<Comm, EpError> {
        nccl_present()?;
        if ranks == 0 || rank >= ranks {
            return Err(EpError::Config(format!("rank {rank} of {ranks} ranks")));
        }
        let ctx = device.context().clone();
        ctx.bind_to_thread()?;
        let mut config = nonblocking_config();
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let uid = sys::ncclUniqueId { internal: id.0.map(|b| b as _) };
        let r = unsafe { sys::ncclCommInitRankConfig(&mut raw, ranks as i32, uid, rank as i32, &mut config) };
        if !matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
            return Err(nccl_err("ncclCommInitRankConfig", r));
        }
        let comm = Comm { raw, rank, ranks, ctx, timeout, aborted: AtomicBool::new(false) };
        comm.wait("ncclCommInitRankConfig")?;
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Ranks in the communicator.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
    /// The deadline every wait uses.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// The context the communicator's device belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn live(&self) -> Result<(), EpError> {
        if self.aborted.load(Ordering::Acquire) {
            Err(EpError::Aborted)
        } else {
            Ok(())
        }
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            tracing::warn!(rank = self.rank, "aborting the NCCL communicator");
            unsafe { sys::ncclCommAbort(self.raw) };
        }
    }

    /// Poll the communicator until its pending call completes, fails or the deadline passes.
    fn wait(&self, call: &'static str) -> Result<(), EpError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let mut st = sys::ncclResult_t::ncclSuccess;
            let r = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut st) };
            if r != sys::ncclResult_t::ncclSuccess {
                self.abort();
                return Err(nccl_err("ncclCommGetAsyncError", r));
            }
            match st {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress if Instant::now() < deadline => std::thread::yield_now(),
                sys::ncclResult_t::ncclInProgress => {
                    self.abort();
                    return Err(EpError::Timeout { what: call, timeout: self.timeout });
                }
                e => {
                    self.abort();
                    return Err(nccl_err(call, e));
                }
            }
        }
    }

    /// The result of a non-blocking call: on failure the communicator is aborted, else the call
    /// is waited on until NCCL has enqueued it.
    fn issued(&self, call: &'static str, r: sys::ncclResult_t) -> Result<(), EpError> {
        if !matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
            self.abort();
            return Err(nccl_err(call, r));
        }
        self.wait(call)
    }

    /// Enqueue `ops` on `stream` as one NCCL group (one kernel for all of them).
    pub(crate) fn group(&self, ops: &[P2p], stream: &CudaStream) -> Result<(), EpError> {
        self.live()?;
        self.ctx.bind_to_thread()?;
        let s = stream.cu_stream() as sys::cudaStream_t;
        let ok = |r: sys::ncclResult_t| matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress);
        let r = unsafe { sys::ncclGroupStart() };
        if !ok(r) {
            return Err(nccl_err("ncclGroupStart", r));
        }
        let mut failed = None;
        for op in ops {
            let r = unsafe {
                match *op {
                    P2p::Send { ptr, bytes, peer } => {
                        sys::ncclSend(ptr as _, bytes, sys::ncclDataType_t::ncclUint8, peer as i32, self.raw, s)
                    }
                    P2p::Recv { ptr, bytes, peer } => {
                        sys::ncclRecv(ptr as _, bytes, sys::ncclDataType_t::ncclUint8, peer as i32, self.raw, s)
                    }
                }
            };
            if !ok(r) {
                failed.get_or_insert(nccl_err("ncclSend/ncclRecv", r));
            }
        }
        let r = unsafe { sys::ncclGroupEnd() };
        if let Some(e) = failed {
            self.abort();
            return Err(e);
        }
        if !ok(r) {
            self.abort();
            return Err(nccl_err("ncclGroupEnd", r));
        }
        self.wait("ncclGroupEnd")
    }

    /// `bytes` of zeroed device memory registered as a symmetric window. Collective: every rank
    /// makes the same windows, in the same order, of the same sizes.
    pub(crate) fn window(&self, bytes: usize, stream: &CudaStream) -> Result<Window, EpError> {
        self.live()?;
        self.ctx.bind_to_thread()?;
        // Any failure aborts the communicator: earlier windows are then freed (as this call's
        // caller unwinds) with no live registration left on them.
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let r = unsafe { sys::ncclMemAlloc(&mut p, bytes) };
        if r != sys::ncclResult_t::ncclSuccess {
            self.abort();
            return Err(nccl_err("ncclMemAlloc", r));
        }
        let mut w = Window { ptr: p as u64, bytes, win: std::ptr::null_mut() };
        if let Err(e) = unsafe { cu::cuMemsetD8Async(w.ptr, 0, bytes, stream.cu_stream()).result() } {
            self.abort();
            return Err(e.into());
        }
        let r = unsafe { sys::ncclCommWindowRegister(self.raw, p, bytes, &mut w.win, WIN_COLL_SYMMETRIC) };
        self.issued("ncclCommWindowRegister", r)?;
        Ok(w)
    }

    /// Chunk `d` of `send` (`bytes` long, at `d * bytes`) to rank `d`'s `recv`, at `rank *
    /// bytes`, for every rank d (this one included: a local copy), enqueued on `stream`. Between
    /// two registered windows within one node NCCL runs it on the copy engines, no SM taken
    /// from the kernels it overlaps; otherwise on its kernels, as a send and a receive per peer.
    pub(crate) fn all_to_all(
        &self,
        send: &Window,
        recv: &Window,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<(), EpError> {
        debug_assert!(bytes * self.ranks <= send.bytes().min(recv.bytes()));
        self.collective("ncclAlltoAll", stream, |s| unsafe {
            sys::ncclAlltoAll(send.ptr() as _, recv.ptr() as _, bytes, sys::ncclDataType_t::ncclUint8, self.raw, s)
        })
    }

    /// A collective `f` issues on `stream` (given as NCCL takes it), not waited for.
    fn collective(
        &self,
        call: &'static str,
        stream: &CudaStream,
        f: impl FnOnce(sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<(), EpError> {
        self.live()?;
        self.ctx.bind_to_thread()?;
        let r = f(stream.cu_stream() as sys::cudaStream_t);
        self.issued(call, r)
    }

    /// Each rank's chunk `rank` of `win` (`bytes` long) to chunk `rank` of every other rank's
    /// `win`: an in-place all-gather, which between symmetric windows NCCL runs on the copy
    /// engines within a node.
    pub(crate) fn all_gather_in_place(&self, win: &Window, bytes: usize, stream: &CudaStream) -> Result<(), EpError> {
        debug_assert!(bytes * self.ranks <= win.bytes());
        let mine = win.ptr() + (self.rank * bytes) as u64;
        self.collective("ncclAllGather", stream, |s| unsafe {
            sys::ncclAllGather(mine as _, win.ptr() as _, bytes, sys::ncclDataType_t::ncclUint8, self.raw, s)
        })
    }

    /// Every rank's `mine` (the same length on each), in rank order; waits on the host.
    pub(crate) fn all_gather(&self, mine: &[u8], stream: &Arc<CudaStream>) -> Result<Vec<u8>, EpError> {
        self.live()?;
        let send = stream.clone_htod(mine)?;
        let mut recv = stream.alloc_zeros::<u8>(mine.len() * self.ranks)?;
        {
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let (sp, _g1) = send.device_ptr(stream);
            let (rp, _g2) = recv.device_ptr_mut(stream);
            self.ctx.bind_to_thread()?;
            let r = unsafe {
                sys::ncclAllGather(
                    sp as _,
                    rp as _,
                    mine.len(),
                    sys::ncclDataType_t::ncclUint8,
                    self.raw,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            };
            self.issued("ncclAllGather", r)?;
        }
        self.synchronize(stream)?;
        Ok(stream.clone_dtoh(&recv)?)
    }

    /// Wait on the host until `stream` has run everything enqueued on it, polling NCCL for
    /// errors; past the deadline the communicator is aborted (its kernels exit) and the wait
    /// fails with [`EpError::Timeout`].
    pub fn synchronize(&self, stream: &CudaStream) -> Result<(), EpError> {
        self.live()?;
        let deadline = Instant::now() + self.timeout;
        loop {
            match unsafe { cu::cuStreamQuery(stream.cu_stream()) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(EpError::Runtime(cudarc::driver::DriverError(e).into())),
            }
            let mut st = sys::ncclResult_t::ncclSuccess;
            unsafe { sys::ncclCommGetAsyncError(self.raw, &mut st) };
            if !matches!(st, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
                self.abort();
                return Err(nccl_err("a transfer", st));
            }
            if Instant::now() >= deadline {
                self.abort();
                return Err(EpError::Timeout { what: "the step", timeout: self.timeout });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Abort, not destroy: it never waits on a peer, and the layer has synchronized its
        // stream (or given up on it) before the communicator goes.
        if !self.aborted.load(Ordering::Acquire) {
            let _ = self.ctx.bind_to_thread();
            unsafe { sys::ncclCommAbort(self.raw) };
        }
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0` and the zero-CTA policy (it changes nothing but
/// which all-to-alls run on the copy engines); every other field unset (NCCL's defaults).
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF_INT: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800, // NCCL_VERSION(2, 28, 0): the layout of these bindings
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: CTA_POLICY_ZERO,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips_through_hex() {
        let mut raw = [0u8; 128];
        raw.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 37 % 256) as u8);
        let id = UniqueId(raw);
        assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap().0, raw);
        assert!(matches!(UniqueId::from_hex("abc"), Err(EpError::Config(_))));
        assert!(matches!(UniqueId::from_hex(&"zz".repeat(128)), Err(EpError::Config(_))));
    }

    #[test]
    fn the_config_is_the_size_nccl_2_28_expects() {
        // size_t, two uints, 4 ints, a pointer, 2 ints, a pointer, 6 ints (NCCL 2.28's nccl.h).
        assert_eq!(std::mem::size_of::<sys::ncclConfig_t>(), 80);
    }
}

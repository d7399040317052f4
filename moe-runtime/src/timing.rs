//! Timing on the device, as benchmarks and examples measure it: CUDA events around graph replays,
//! warm-up first, medians, and the device-to-device copy bandwidth as the ceiling.

use crate::error::Result;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};
use std::sync::Arc;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Capture what `f` enqueues on `s` into an instantiated graph.
pub fn capture(s: &Arc<CudaStream>, f: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    s.synchronize()?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let enqueued = f();
    let graph = s.end_capture(CUgraphInstantiate_flags(0))?;
    enqueued?;
    Ok(graph.expect("a capture that enqueued work yields a graph"))
}

/// Median microseconds of one replay of `g`, each replay timed with its own pair of events,
/// after five warm-up replays.
pub fn time_graph(s: &Arc<CudaStream>, g: &CudaGraph, reps: usize) -> Result<f64> {
    for _ in 0..5 {
        g.launch()?;
    }
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        g.launch()?;
        let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        b.synchronize()?;
        t.push(a.elapsed_ms(&b)? as f64 * 1e3);
    }
    Ok(median(t))
}

/// Device-to-device copy bandwidth in GB/s over a 1 GiB buffer, counting bytes read plus bytes
/// written (median of 20 copies after 5 warm-ups).
pub fn copy_gbps(s: &Arc<CudaStream>) -> Result<f64> {
    let n = 1usize << 30;
    let src = s.alloc_zeros::<u8>(n)?;
    let mut dst = s.alloc_zeros::<u8>(n)?;
    let mut t = Vec::new();
    for i in 0..25 {
        let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        s.memcpy_dtod(&src, &mut dst)?;
        let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        b.synchronize()?;
        if i >= 5 {
            t.push(a.elapsed_ms(&b)? as f64 * 1e-3);
        }
    }
    Ok(2.0 * n as f64 / median(t) / 1e9)
}

/// Today's UTC date, `YYYY-MM-DD`, for benchmark rows.
pub fn today() -> String {
    let days =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64 / 86400;
    civil_date(days)
}

/// The civil date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_date(days: i64) -> String {
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    format!("{:04}-{:02}-{:02}", yoe + era * 400 + (m <= 2) as i64, m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn civil_dates() {
        assert_eq!(super::civil_date(0), "1970-01-01");
        assert_eq!(super::civil_date(20_413), "2025-11-21");
        assert_eq!(super::civil_date(11_016), "2000-02-29");
    }
}

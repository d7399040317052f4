// Kernel timeline of any CUDA program, graph replays included, for the lent machines (which have
// no nsys). Loaded by the driver through CUDA_INJECTION64_PATH; writes one CSV row per kernel to
// $MOE_TRACE_OUT at exit. CONCURRENT_KERNEL records do not serialise kernels, so programmatic
// dependent launches still overlap as they do untraced. Built on the device by build.sh.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KREC
#error "build.sh passes -DKREC=<the header's newest CUpti_ActivityKernelN>"
#endif

static FILE *out;

static void CUPTIAPI requested(uint8_t **buf, size_t *size, size_t *max_records) {
  *size = 8 << 20;
  *buf = aligned_alloc(8, *size);
  *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
  (void)ctx;
  (void)stream;
  (void)size;
  CUpti_Activity *rec = NULL;
  while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL)
      continue;
    const KREC *k = (const KREC *)rec;
    fprintf(out, "%u,%u,%llu,%u,%llu,%llu,%u,%u,%u,%u,%u,%u,%u,%u,%s\n", k->correlationId, k->graphId,
            (unsigned long long)k->graphNodeId, k->streamId, (unsigned long long)k->start,
            (unsigned long long)k->end, k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ,
            k->dynamicSharedMemory, k->staticSharedMemory, k->sharedMemoryExecuted,
            (unsigned)k->sharedMemoryCarveoutRequested, (unsigned)k->registersPerThread,
            (unsigned)k->launchType, k->name ? k->name : "?");
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped);
  if (dropped) fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
  free(buf);
}

static void flush_at_exit(void) {
  cuptiActivityFlushAll(1);
  if (out) fclose(out);
}

int InitializeInjection(void) {
  const char *path = getenv("MOE_TRACE_OUT");
  out = fopen(path ? path : "kernels.csv", "w");
  if (!out) return 0;
  fprintf(out, "corr,graph,node,stream,start,end,grid,block,dyn_smem,static_smem,smem_executed,"
               "carveout_req,regs,launch_type,name\n");
  if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    fprintf(stderr, "cupti_trace: could not enable kernel records\n");
    return 0;
  }
  atexit(flush_at_exit);
  return 1;
}

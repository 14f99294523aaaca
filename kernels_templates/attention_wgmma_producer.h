// Attention templates: the warp-specialized sm_90a forward: producer warps load (TMA for
// values, registers for rotated keys) into mbarrier-guarded stages, consumer warpgroups
// compute; optionally in thread-block clusters that share value tiles.
#ifndef ROPE_JIT_ATTENTION_WGMMA_PRODUCER_H
#define ROPE_JIT_ATTENTION_WGMMA_PRODUCER_H

namespace {

namespace tc {

namespace wg {

// ---- the warp-specialized forward: producer warps load and rotate, consumers compute ----
//
// PRODUCER_WARPS (4) warps after the WARPS consumer warps fill STAGES key/value buffers; the
// consumers (warpgroups of 64 query rows, as in forward) wait for a tile's keys (`full`) and
// values (`landed`), compute, and signal `empty` when they are done with its buffers. No
// block-wide barrier in the loop: the consumer warpgroups drift apart, so one's softmax
// overlaps another's tensor-core work, and loading and rotating overlap both. The tensor cores
// read everything from shared memory: the rotated query rows (q_tile), keys and values, all
// 128-byte swizzled (SWIZZLED).
//
// Values arrive through the tensor memory accelerator (TMA): one copy per 64-feature region
// of a tile lands its rows swizzled, zero past the sequence and past head_dim, and signals the
// buffer's `landed` barrier by bytes. Keys go through the producers' registers, rotated there
// (below), and the producers arrive on `full` once they are stored. (Copied 16 bytes a thread,
// or by TMA one 16-byte chunk column at a time, the tiles cost more L2 requests than the
// tensor cores need time: that bound the forward.)
//
// CLUSTER > 1: the CLUSTER blocks of a thread-block cluster are consecutive query heads of
// one GQA group (same keys, same query rows). Each block copies only its share of every value
// tile's rows (SHARE_ROWS of them), multicast into the buffers of every block, so values cross
// from L2 once per cluster. A buffer is free again once the consumers of every block are done
// with it: `empty` counts them all.
constexpr int PRODUCER_THREADS = PRODUCER_WARPS * 32;
constexpr int SHARE_ROWS = BLOCK_N / CLUSTER;  // key rows of a tile each block copies
constexpr int TILE_BOXES = DP / 64;            // TMA copies of one value tile
// Swizzled TMA boxes land where the pattern starts: tile buffers at multiples of 1024 bytes
// (the shares of 8-row multiples are too).
static_assert(PRODUCER_WARPS == 0 ||
                  (SMEM.k % 1024 == 0 && SMEM.v0 % 1024 == 0 && SMEM.q_tile % 1024 == 0),
              "swizzled tiles 1024-byte aligned");
static_assert(CLUSTER == 1 ||
                  (PRODUCER_WARPS > 0 && SHARE_ROWS % 8 == 0 && GQA_GROUP % CLUSTER == 0),
              "clusters of producer blocks over whole 8-row shares of a GQA group");

// mbarrier operations on 8-byte barriers in shared memory (addresses from shared_address, or
// shared::cluster addresses from cluster_address for the remote arrive).
__device__ __forceinline__ void barrier_init(unsigned address, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned address) {
    asm volatile(
        "{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(address)
        : "memory");
}
// Arrives, and expects `bytes` more of asynchronous copies in the current phase.
__device__ __forceinline__ void barrier_arrive_expect(unsigned address, unsigned bytes) {
    asm volatile(
        "{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::
            "r"(address),
        "r"(bytes)
        : "memory");
}
// Arrives on the barrier at `address` (shared::cluster, possibly another block's), releasing
// this thread's earlier writes at cluster scope.
__device__ __forceinline__ void barrier_arrive_cluster(unsigned address) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(address)
                 : "memory");
}
// Waits until the phase of parity `parity` (the barrier's n-th completion has parity n & 1)
// has completed; with CLUSTER > 1 acquiring at cluster scope (arrivals and copies come from
// other blocks too).
__device__ __forceinline__ void barrier_wait(unsigned address, unsigned parity) {
    if constexpr (CLUSTER > 1)
        asm volatile(
            "{\n.reg .pred done;\nretry:\n"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra retry;\n}\n" ::"r"(address),
            "r"(parity)
            : "memory");
    else
        asm volatile(
            "{\n.reg .pred done;\nretry:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra retry;\n}\n" ::"r"(address),
            "r"(parity)
            : "memory");
}
// A barrier among the consumer warps. Each named barrier below first reconverges the warp:
// bar.sync counts a whole warp per execution, so a warp still split by a lane-dependent branch
// (a masked key, say) would count twice and could release the barrier early.
__device__ __forceinline__ void consumer_sync() {
    __syncwarp();
    asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
}

// ---- experiments of the consumer schedule (PINGPONG, SETMAXNREG; off by default) ----
//
// PINGPONG: the two consumer warpgroups take turns issuing their products, so that one's
// softmax (its exponentials take about half the time of a tile's two products) runs while the
// other's products keep the tensor cores busy, rather than both in phase (FlashAttention-3's
// warp scheduler barriers). A turn is one product issued: S = Q K^T (PINGPONG 1), or S and,
// separately, O += P V (PINGPONG 2). Warpgroup g takes its turn by bar.sync on named barrier
// TURN_BARRIER + g (both warpgroups' 256 threads count) and passes it by bar.arrive on the
// other's. Warpgroup 1 arrives once on warpgroup 0's barrier at the start (0 goes first) and
// warpgroup 0 syncs once more at the end, so every barrier phase gets its 128 syncs and 128
// arrivals; a warpgroup takes its turns for every tile of the block, also for the tiles it
// skips (causal: its rows end before them), so both take the same number.
// Named barriers: 0 __syncthreads, 1 consumer_sync, 2-3 the turns, 4-5 warpgroup_sync.
constexpr int TURN_BARRIER = 2;  // and 3
constexpr int TURN_THREADS = 256;
static_assert(PINGPONG == 0 || (WARPS == 8 && PRODUCER_WARPS == 4), "turns of two warpgroups");
__device__ __forceinline__ void turn_sync(int barrier) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(barrier), "n"(TURN_THREADS) : "memory");
}
__device__ __forceinline__ void turn_arrive(int barrier) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(barrier), "n"(TURN_THREADS) : "memory");
}
struct ConsumerTurns {
    int mine, other;  // named barriers: this warpgroup's turn, the other's
    __device__ __forceinline__ void before_scores() const { turn_sync(mine); }
    __device__ __forceinline__ void after_scores() const { turn_arrive(other); }
    __device__ __forceinline__ void before_values() const {
        if constexpr (PINGPONG == 2) turn_sync(mine);
    }
    __device__ __forceinline__ void after_values() const {
        if constexpr (PINGPONG == 2) turn_arrive(other);
    }
    // The turns of a tile this warpgroup skips.
    __device__ __forceinline__ void skip() const {
        before_scores();
        after_scores();
        before_values();
        after_values();
    }
};

// SETMAXNREG (keys by TMA: producers that only issue copies): the producer warpgroup gives
// registers back and the consumers take them (registers per thread, multiples of 8; the
// launch bound gives every thread 65536 / 384 = 168 at entry).
constexpr int PRODUCER_REGISTERS = 40;
constexpr int CONSUMER_REGISTERS =
    (65536 - PRODUCER_THREADS * PRODUCER_REGISTERS) / (THREADS > 0 ? THREADS : 1) / 8 * 8 > 256
        ? 256
        : (65536 - PRODUCER_THREADS * PRODUCER_REGISTERS) / (THREADS > 0 ? THREADS : 1) / 8 * 8;
static_assert(!SETMAXNREG || (KEYS_BY_TMA && PRODUCER_WARPS == 4), "producers that only copy");

// Thread-block cluster helpers: this block's rank, the shared::cluster address of a shared
// address in block `rank`, and a barrier of every thread of the cluster.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}
__device__ __forceinline__ unsigned cluster_address(unsigned address, unsigned rank) {
    unsigned mapped;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(address), "r"(rank));
    return mapped;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Copies one box of a [B, H, S, D] tensor (`map`: its TMA descriptor, in the kernel's
// parameters) from feature `feature`, token `token` of head `head`, batch `batch` into shared
// `dst`, counting its bytes on `landed`; with CLUSTER > 1 into the same place of every block.
__device__ __forceinline__ void copy_box(unsigned dst, const void* map, int feature, int token,
                                         int head, int batch, unsigned landed) {
    const unsigned long long descriptor = reinterpret_cast<unsigned long long>(map);
    if constexpr (CLUSTER > 1)
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast:"
            ":cluster"
            " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
            "l"(descriptor), "r"(feature), "r"(token), "r"(head), "r"(batch), "r"(landed),
            "h"(static_cast<unsigned short>((1u << CLUSTER) - 1u))
            : "memory");
    else
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
            "l"(descriptor), "r"(feature), "r"(token), "r"(head), "r"(batch), "r"(landed)
            : "memory");
}

// The pipeline's shared state: buffers and barriers (this block's shared addresses), and the
// shared::cluster address of this block's shared memory in each block of the cluster.
struct Pipeline {
    char* smem;
    unsigned landed, full, empty;
    unsigned window[CLUSTER];

    static constexpr int TILE_BYTES = BLOCK_N * DP * 2;
    __device__ __forceinline__ char* key_tile(int t) const {
        return smem + SMEM.k + (t % STAGES) * TILE_BYTES;
    }
    __device__ __forceinline__ char* value_tile(int t) const {
        return smem + SMEM.v0 + (t % STAGES) * TILE_BYTES;
    }
    __device__ __forceinline__ unsigned landed_of(int t) const { return landed + (t % STAGES) * 8; }
    __device__ __forceinline__ unsigned full_of(int t) const { return full + (t % STAGES) * 8; }
    __device__ __forceinline__ unsigned empty_of(int t) const { return empty + (t % STAGES) * 8; }
    // The parity of tile t's phase of its buffer's barriers (tile t is their (t / STAGES)-th use).
    __device__ __forceinline__ static unsigned phase_of(int t) {
        return static_cast<unsigned>(t / STAGES) & 1u;
    }
    // Block `rank`'s address of this block's shared `address`.
    __device__ __forceinline__ unsigned in_block(unsigned address, int rank) const {
        return window[rank] + (address - shared_address(smem));
    }
};

// ---- the producers' keys: through registers, rotated on the way ----
//
// Each producer thread loads its items of the next key tile (key chunks and table columns)
// from global memory into registers while the consumers work on earlier tiles, then rotates
// them there and stores them into the tile's buffer: shared memory sees each key once,
// written, and then only the tensor cores' reads. (Landed by TMA and rotated in place, a tile
// was read and written back once more, beside staged table rows written and read: that
// traffic competed with the tensor cores for shared memory and bound the forward.)
// A thread keeps one item number (items numbered as in rotate_rows) in every row it takes:
// ITEM_SLOTS consecutive threads cover a row (those past ITEMS idle), eight of them reading 128
// consecutive bytes, and a pass of the producers covers ROWS_PER_PASS rows. Rows a pass apart
// are a multiple of 8 apart, so a thread's swizzle pattern, its table columns and its address
// steps are the same in every row: the producers compute addresses once per tile, not per
// item. (The producers, one warp beside two consumer warps on each scheduler, are the
// forward's critical path: instructions they save are time.)
constexpr int ITEM_SLOTS = ITEMS <= 4 ? 4 : ITEMS <= 8 ? 8 : ITEMS <= 16 ? 16 : 32;
constexpr int ROWS_PER_PASS = PRODUCER_THREADS > 0 ? PRODUCER_THREADS / ITEM_SLOTS : 1;
constexpr int KEY_LOADS =
    PRODUCER_WARPS > 0 ? BLOCK_N / ROWS_PER_PASS : 1;  // rows per thread and tile
static_assert(PRODUCER_WARPS == 0 || KEYS_BY_TMA ||
                  (ITEMS <= 32 && ROWS_PER_PASS % 8 == 0 && BLOCK_N % ROWS_PER_PASS == 0),
              "producer passes of whole 8-row swizzle patterns");
// Raw table bits of one rotation item's ITEM_PAIRS pairs: the columns' bytes as they are
// (TABLE_STEP 1), or one word per pair, a 16-bit value in its low half (TABLE_STEP 2: every
// other column). Kept raw so that no instruction waits for the loads before the tile's turn.
constexpr int ITEM_WORDS = TABLE_STEP == 1 ? ITEM_PAIRS * TBYTES / 4 : ITEM_PAIRS;
static_assert(TABLE_STEP == 2 || ITEM_WORDS == 2 || ITEM_WORDS % 4 == 0,
              "table pieces of 8 bytes or whole 16");

__device__ __forceinline__ U4 load_global16(const void* at) {
    U4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
                 : "l"(at));
    return v;
}

// The raw table bits of an item's pairs (`at`: the first one's column in its table row).
__device__ __forceinline__ void load_item_table(unsigned (&words)[ITEM_WORDS], const char* at) {
    if constexpr (TABLE_STEP == 2) {
#pragma unroll
        for (int e = 0; e < ITEM_PAIRS; ++e) {
            if constexpr (TBYTES == 4)
                asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(words[e]) : "l"(at + 8 * e));
            else
                asm volatile("ld.global.nc.u16 %0, [%1];\n" : "=r"(words[e]) : "l"(at + 4 * e));
        }
    } else if constexpr (ITEM_WORDS % 4 == 0) {
#pragma unroll
        for (int v = 0; v < ITEM_WORDS / 4; ++v) {
            const U4 w = load_global16(at + 16 * v);
#pragma unroll
            for (int e = 0; e < 4; ++e) words[4 * v + e] = w.w[e];
        }
    } else {
        asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n"
                     : "=r"(words[0]), "=r"(words[1])
                     : "l"(at));
    }
}

// The angle (cos or sin) of pair e of an item from its raw table bits.
__device__ __forceinline__ float item_angle(const unsigned (&words)[ITEM_WORDS], int e) {
    if constexpr (TBYTES == 4)
        return __uint_as_float(words[e]);
    else {
        const unsigned bits = TABLE_STEP == 2 ? words[e] : words[e / 2] >> (16 * (e % 2));
        return float_of_bits16<TABLE_DTYPE>(static_cast<unsigned short>(bits & 0xffffu));
    }
}

// What a producer thread loads and where it stores, the same in every tile: its item, the
// byte offsets of its chunks in a key row and of its columns in a table row, its first row in
// a tile and where that row's chunks go in the tile buffer.
struct KeyItems {
    bool active, rotated;
    int row0, store_a, store_b;
    int chunk_a, chunk_b, column;
    long long key_step, cos_step, sin_step;  // bytes between a thread's rows (a pass apart)
};

template <int D = DTYPE>
__device__ __forceinline__ KeyItems key_items(const AttentionKernelParams& p, int thread) {
    KeyItems k;
    const int item = thread % ITEM_SLOTS;
    k.active = item < ITEMS;
    k.rotated = ROTATE && item < ROT_ITEMS;
    k.row0 = thread / ITEM_SLOTS;
    const int chunk = item < ROT_ITEMS ? item : FIRST_PLAIN + item - ROT_ITEMS;
    const int partner = chunk + ROTARY_DIM / 16;  // half style: the chunk of the partners
    k.chunk_a = chunk * 16;
    k.chunk_b = partner * 16;
    k.store_a = swizzled_offset(k.row0, chunk);
    k.store_b = swizzled_offset(k.row0, partner);
    k.column = table_column(item * ITEM_PAIRS) * TBYTES;
    k.key_step = ROWS_PER_PASS * p.k_stride[2] * static_cast<long long>(sizeof(T));
    k.cos_step = ROWS_PER_PASS * p.cos_stride[0] * TBYTES;
    k.sin_step = ROWS_PER_PASS * p.sin_stride[0] * TBYTES;
    return k;
}

struct KeyLoads {
    U4 a[KEY_LOADS], b[KEY_LOADS];  // an item's chunk, and (half style) its partner chunk
    unsigned cos[KEY_LOADS][ITEM_WORDS], sin[KEY_LOADS][ITEM_WORDS];
};

// Starts loading this thread's items of the key tile from token n0: rows past the sequence
// and chunks past head_dim load nothing and stay zero, with zero angles (CHECKED; a tile
// wholly inside the sequence takes the path without the checks).
template <bool CHECKED, int D = DTYPE>
__device__ __forceinline__ void load_keys(KeyLoads& r, const KeyItems& k,
                                          const AttentionKernelParams& p, const T* k_head,
                                          long long n0) {
    const long long row = n0 + k.row0;
    const char* key = reinterpret_cast<const char*>(k_head + row * p.k_stride[2]);
    const char* cos = static_cast<const char*>(p.cos) + row * p.cos_stride[0] * TBYTES + k.column;
    const char* sin = static_cast<const char*>(p.sin) + row * p.sin_stride[0] * TBYTES + k.column;
#pragma unroll
    for (int j = 0; j < KEY_LOADS; ++j) {
        const bool valid = !CHECKED || row + j * ROWS_PER_PASS < p.seqlen_k;
        // (Chunks past head_dim are zero in every tile, as the query rows' are.)
        r.a[j] =
            valid && k.active && k.chunk_a < DCHUNKS * 16 ? load_global16(key + k.chunk_a) : U4{};
        if (CHECKED) {
            r.b[j] = U4{};
#pragma unroll
            for (int e = 0; e < ITEM_WORDS; ++e) r.cos[j][e] = r.sin[j][e] = 0u;
        }
        if (valid && k.rotated) {
            if constexpr (!INTERLEAVED) r.b[j] = load_global16(key + k.chunk_b);
            load_item_table(r.cos[j], cos);
            load_item_table(r.sin[j], sin);
        }
        key += k.key_step;
        cos += k.cos_step;
        sin += k.sin_step;
    }
}

// Rotates this thread's loaded items and stores them into the key tile at `tile`.
template <int D = DTYPE>
__device__ __forceinline__ void store_keys(KeyLoads& r, const KeyItems& k, char* tile) {
    if (!k.active) return;
#pragma unroll
    for (int j = 0; j < KEY_LOADS; ++j) {
        char* const row = tile + j * ROWS_PER_PASS * 128;  // whole swizzle patterns on
        U4 x = r.a[j];
        if (k.rotated) {
            const auto angles = [&](int e, float(&c)[2], float(&s)[2]) {
#pragma unroll
                for (int f = 0; f < 2; ++f) {
                    c[f] = item_angle(r.cos[j], e + f);
                    s[f] = item_angle(r.sin[j], e + f);
                }
            };
            if constexpr (INTERLEAVED) {
                rotate_pair_chunk(x, angles);
            } else {
                U4 y = r.b[j];
                rotate_half_chunks(x, y, angles);
                *reinterpret_cast<U4*>(row + k.store_b) = y;
            }
        }
        *reinterpret_cast<U4*>(row + k.store_a) = x;
    }
}

// Loads tile t's keys: the checked path only for a tile that reaches past the sequence.
template <int D = DTYPE>
__device__ __forceinline__ void load_key_tile(KeyLoads& r, const KeyItems& k,
                                              const AttentionKernelParams& p, const T* k_head,
                                              int t) {
    const long long n0 = static_cast<long long>(t) * BLOCK_N;
    if (n0 + BLOCK_N <= p.seqlen_k)
        load_keys<false>(r, k, p, k_head, n0);
    else
        load_keys<true>(r, k, p, k_head, n0);
}

// The producers. Values arrive by TMA, issued STAGES - 1 tiles ahead (this block's share of
// each tile's rows); with KEYS_BY_TMA keys too, from k_map (the keys rotated beforehand by
// the prepare kernel, or k itself without rotation), counted on the same barrier. Otherwise
// keys go through the producers' registers one tile ahead: tile t's are loaded while tile
// t - 1's are stored, so their latency overlaps the waits for the consumers. A tile's buffer
// is reused once the consumers released the tile STAGES before.
template <int D = DTYPE>
__device__ void produce(const Pipeline& pipe, const AttentionKernelParams& p, const T* k_head,
                        long long b, long long hk, int tiles, int rank) {
    const int thread = static_cast<int>(threadIdx.x) - THREADS;
    // With KEYS_BY_TMA the producers only issue copies: one warp does (box b: its lane b), and
    // the other three leave at once rather than spin on the `empty` barriers, which would take
    // issue slots from the consumer warps on their schedulers. (No later barrier counts them:
    // the consumers' named barriers count consumers only.) Otherwise the TILE_BOXES value boxes
    // of a tile go to lane 0 of each producer warp in turn, then lane 1, ...
    if (KEYS_BY_TMA && thread >= 32) return;
    const int box = KEYS_BY_TMA ? thread : (thread & 31) * PRODUCER_WARPS + (thread >> 5);
    auto issue_values = [&](int t) {
        if (thread == 0)
            barrier_arrive_expect(pipe.landed_of(t), (KEYS_BY_TMA ? 2 : 1) * Pipeline::TILE_BYTES);
        if (box < TILE_BOXES) {
            const int offset = swizzled_offset(rank * SHARE_ROWS, box * 8);
            const int token = t * BLOCK_N + rank * SHARE_ROWS;
            copy_box(shared_address(pipe.value_tile(t) + offset), p.v_map, box * 64, token,
                     static_cast<int>(hk), static_cast<int>(b), pipe.landed_of(t));
            if constexpr (KEYS_BY_TMA)
                copy_box(shared_address(pipe.key_tile(t) + offset), p.k_map, box * 64, token,
                         static_cast<int>(hk), static_cast<int>(b), pipe.landed_of(t));
        }
    };
    for (int t = 0; t < STAGES - 1 && t < tiles; ++t) issue_values(t);
    if constexpr (KEYS_BY_TMA) {
        for (int t = 0; t + STAGES - 1 < tiles; ++t) {
            if (t >= 1) barrier_wait(pipe.empty_of(t - 1), Pipeline::phase_of(t - 1));
            issue_values(t + STAGES - 1);
        }
        return;
    }
    const KeyItems items = key_items(p, thread);
    KeyLoads keys;
    if (tiles > 0) load_key_tile(keys, items, p, k_head, 0);
    for (int t = 0; t < tiles; ++t) {
        if (t >= STAGES) barrier_wait(pipe.empty_of(t - STAGES), Pipeline::phase_of(t - STAGES));
        store_keys(keys, items, pipe.key_tile(t));
        fence_async_proxy();  // the keys, for the tensor cores
        barrier_arrive(pipe.full_of(t));
        if (t + 1 < tiles) load_key_tile(keys, items, p, k_head, t + 1);
        const int next = t + STAGES - 1;
        if (next < tiles) {
            if (t >= 1) barrier_wait(pipe.empty_of(t - 1), Pipeline::phase_of(t - 1));
            issue_values(next);
        }
    }
}

// The default schedule: per tile S = Q K^T, the softmax and O += P V one after the other (the
// other consumer warpgroup's work fills the gaps), with turns (PINGPONG) if asked.
template <int D = DTYPE>
__device__ __forceinline__ void attend_serial(const Pipeline& pipe, float (&o)[DTILES][4],
                                              float (&row_max)[2], float (&row_sum)[2],
                                              unsigned q_group_tile,
                                              const AttentionKernelParams& p, long long b,
                                              long long row_first, long long group_first,
                                              int tiles, int lane, const ConsumerTurns& turns) {
    const int group_first32 = static_cast<int>(group_first);  // (tokens fit 32 bits)
    for (int t = 0; t < tiles; ++t) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        if constexpr (!KEYS_BY_TMA)
            barrier_wait(pipe.full_of(t), Pipeline::phase_of(t));  // keys stored
        barrier_wait(pipe.landed_of(t), Pipeline::phase_of(t));    // values (and keys) landed
        // A causal warpgroup whose rows all end before the tile skips it (it still releases
        // the buffer: every consumer arrives once per tile).
        if (!CAUSAL || t * BLOCK_N - 63 <= group_first32) {
            unsigned pa[BLOCK_N / 16][4];
            if constexpr (PINGPONG > 0)
                attend_tile(o, pa, row_max, row_sum, q_group_tile, pipe.key_tile(t),
                            pipe.value_tile(t), p, b, row_first, group_first, n0, lane, turns);
            else
                attend_tile(o, pa, row_max, row_sum, q_group_tile, pipe.key_tile(t),
                            pipe.value_tile(t), p, b, row_first, group_first, n0, lane);
            wait_all();
            fence_registers(o);
            fence_registers(pa);
        } else if constexpr (PINGPONG > 0) {
            turns.skip();
        }
        if constexpr (CLUSTER > 1) {
#pragma unroll
            for (int r = 0; r < CLUSTER; ++r)
                barrier_arrive_cluster(pipe.in_block(pipe.empty_of(t), r));
        } else {
            barrier_arrive(pipe.empty_of(t));
        }
    }
}

// ---- OVERLAP: a warpgroup's softmax beside its own previous product ----
//
// Tile t's S = Q K^T and tile t - 1's O += P V are in flight together; once S is done the
// softmax of tile t runs while O += P V still does (FlashAttention-3's intra-warpgroup
// overlap). The output accumulators move to tile t's row maxima after that product, which
// also releases tile t - 1's buffers. Holding tile t's scores beside P of tile t - 1 and the
// accumulators takes setmaxnreg's registers. A causal warpgroup attends tiles [0, own) and
// only releases the later ones (their keys all come after its rows). Tile 0 is peeled off the
// loop: with the first tile's products behind a branch inside it, ptxas 13.0 judged the
// pipeline ill-formed and serialized every wgmma of the kernel (a wait after each one).
static_assert(!OVERLAP || (SETMAXNREG && PINGPONG == 0 && CLUSTER == 1),
              "overlap with setmaxnreg, without turns or clusters");
template <int D = DTYPE>
__device__ __forceinline__ void attend_overlapped(const Pipeline& pipe, float (&o)[DTILES][4],
                                                  float (&row_max)[2], float (&row_sum)[2],
                                                  unsigned q_group_tile,
                                                  const AttentionKernelParams& p, long long b,
                                                  long long row_first, long long group_first,
                                                  int tiles, int lane) {
    constexpr int NT = BLOCK_N / 8;
    const int last_row = static_cast<int>(group_first) + 63;  // (tokens fit 32 bits)
    const int own = CAUSAL ? min(tiles, last_row / BLOCK_N + 1) : tiles;
    unsigned pa[NT / 2][4];
    if (own > 0) {  // tile 0: its scores alone
        barrier_wait(pipe.landed_of(0), Pipeline::phase_of(0));
        float s[NT][4];
        issue_scores(s, q_group_tile, pipe.key_tile(0));
        wait_all();
        fence_registers(s);
        float alphas[2];
        soften_tile(s, row_max, row_sum, alphas, p, b, row_first, group_first, 0, lane);
        to_a_fragments<NT>(pa, s);  // (o is still zero: nothing to rescale)
    }
    for (int t = 1; t < own; ++t) {
        barrier_wait(pipe.landed_of(t), Pipeline::phase_of(t));
        float s[NT][4];
        issue_scores(s, q_group_tile, pipe.key_tile(t));
        issue_values(o, pa, pipe.value_tile(t - 1));
        wait_pending<1>();  // the scores; tile t - 1's product runs on
        fence_registers(s);
        float alphas[2];
        soften_tile(s, row_max, row_sum, alphas, p, b, row_first, group_first,
                    static_cast<long long>(t) * BLOCK_N, lane);
        wait_all();
        fence_registers(o);
        fence_registers(pa);
        barrier_arrive(pipe.empty_of(t - 1));
        rescale_output<true>(o, alphas);
        to_a_fragments<NT>(pa, s);
    }
    if (own > 0) {
        issue_values(o, pa, pipe.value_tile(own - 1));
        wait_all();
        fence_registers(o);
        fence_registers(pa);
        barrier_arrive(pipe.empty_of(own - 1));
    }
    for (int t = own; t < tiles; ++t) {
        barrier_wait(pipe.landed_of(t), Pipeline::phase_of(t));
        barrier_arrive(pipe.empty_of(t));
    }
}

// ---- the consumers' query rows: straight into the swizzled tile, rotated in place ----
//
// The block's RESIDENT query rows live only in q_tile, where the tensor cores read them:
// warpgroup g's 64 rows as a 64-row key tile would be (128-byte swizzled regions of 64
// features). They arrive raw by cp.async (zero past the sequence and past head_dim) and each
// thread rotates whole chunk pairs in place, reading its angles from the tables; at the end
// each warp stages its output rows in its own 16 query rows.
__device__ __forceinline__ int query_tile_offset(int row, int chunk) {
    return (row >> 6) * QUERY_GROUP_BYTES + swizzled_offset<64>(row & 63, chunk);
}

template <int D = DTYPE>
__device__ __forceinline__ void load_query_tile(char* q_tile, const T* q_head, long long stride,
                                                long long m0, long long seqlen_q) {
    for (int c = threadIdx.x; c < RESIDENT * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, ch = c - r * CHUNKS;
        const bool ok = m0 + r < seqlen_q && ch < DCHUNKS;
        cp_async16(q_tile + query_tile_offset(r, ch),
                   ok ? q_head + (m0 + r) * stride + ch * 8 : q_head, ok);
    }
}

// Rotates the query rows of q_tile in place (items as in rotate_rows: chunks of interleaved
// pairs, or first-half chunks with their partners R/2 later); rows past the sequence stay zero.
template <int D = DTYPE>
__device__ __forceinline__ void rotate_query_tile(char* q_tile, const AttentionKernelParams& p,
                                                  long long m0) {
    if constexpr (ROTATE) {
        for (int it = threadIdx.x; it < RESIDENT * ROT_ITEMS; it += THREADS) {
            const int r = it / ROT_ITEMS, k = it - r * ROT_ITEMS;
            const long long token = m0 + r;
            if (token >= p.seqlen_q) continue;
            U4* const xa = reinterpret_cast<U4*>(q_tile + query_tile_offset(r, k));
            U4 a = *xa;
            if constexpr (INTERLEAVED) {
                rotate_pairs_chunk<false>(a, p, nullptr, nullptr, r, token, k * 4);
            } else {
                U4* const xb =
                    reinterpret_cast<U4*>(q_tile + query_tile_offset(r, k + ROTARY_DIM / 16));
                U4 bb = *xb;
                rotate_halves_chunks<false>(a, bb, p, nullptr, nullptr, r, token, k * 8);
                *xb = bb;
            }
            *xa = a;
        }
    }
}

// A warp's 16 staging rows in q_tile: rows first.. of the block (a warp's own, in its
// warpgroup's swizzled layout).
struct SwizzledQueryRows {
    char* q_tile;
    int first;
    __device__ __forceinline__ T* at(int row, int element) const {
        return reinterpret_cast<T*>(q_tile + query_tile_offset(first + row, element >> 3)) +
               (element & 7);
    }
};

// A barrier among the four warps of consumer warpgroup `group` (named barriers 4 and 5).
__device__ __forceinline__ void warpgroup_sync(int group) {
    __syncwarp();  // reconverged first, as consumer_sync says
    asm volatile("bar.sync %0, 128;\n" ::"r"(4 + group) : "memory");
}

template <int D = DTYPE>
__device__ void forward_specialized(const AttentionKernelParams& p, char* smem) {
    static_assert(WARPS % 4 == 0 && PRODUCER_WARPS == 4 && M_TILES == 1 && !HAS_POS_MASK,
                  "consumer warpgroups of 16-row warps, one producer warpgroup, no pos_mask");
    static_assert(STAGES == 2 || STAGES == 3, "two or three tiles in shared memory");
    static_assert(TABLE_ASYNC || !ROTATE || KEYS_BY_TMA,
                  "the producers load table columns in 8- or 16-byte pieces");
    Pipeline pipe;
    pipe.smem = smem;
    pipe.landed = shared_address(smem + SMEM.barriers);
    pipe.full = pipe.landed + STAGES * 8;
    pipe.empty = pipe.full + STAGES * 8;
    const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0u;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r)
        pipe.window[r] = CLUSTER > 1 ? cluster_address(shared_address(smem), r) : 0u;
    const auto [b, h, m0, q_head, k_head, v_head, tiles] = query_block(p);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(pipe.landed + s * 8, 1);
            barrier_init(pipe.full + s * 8, PRODUCER_THREADS);
            barrier_init(pipe.empty + s * 8, CLUSTER * THREADS);
        }
        // The initialized barriers, visible to the TMA unit (async proxy) and, in a cluster, to
        // the other blocks.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // The last barrier of the whole block (cluster): producers and consumers part here, and
    // no block writes into another before that one's barriers exist.
    if constexpr (CLUSTER > 1)
        cluster_sync();
    else
        __syncthreads();

    if (threadIdx.x >= THREADS) {
        if constexpr (SETMAXNREG)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGISTERS));
        produce(pipe, p, k_head, b, h / GQA_GROUP, tiles, static_cast<int>(rank));
        if constexpr (CLUSTER > 1) cluster_sync();  // no block exits while another may still use it
        return;
    }

    // Consumers: the block's query rows, rotated, then the key tiles as they come.
    if constexpr (SETMAXNREG)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGISTERS));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    char* const q_tile = smem + SMEM.q_tile;
    load_query_tile(q_tile, q_head, p.q_stride[2], m0, p.seqlen_q);
    cp_async_commit();
    cp_async_wait_all();
    consumer_sync();
    rotate_query_tile(q_tile, p, m0);
    fence_async_proxy();
    consumer_sync();

    // The warpgroup, broadcast from lane 0: ptxas then knows it is the same in every lane and
    // keeps what derives from it (the tile skip, the descriptors) in uniform registers, without
    // a divergent branch or register-to-uniform moves per tile.
    const int group = __shfl_sync(FULL_MASK, warp >> 2, 0);
    const unsigned q_group_tile = shared_address(q_tile + group * QUERY_GROUP_BYTES);
    const long long row_first = m0 + warp * 16;
    const long long group_first = m0 + group * 64;  // this warpgroup's first query row
    float o[DTILES][4];
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    zero(o);
    const ConsumerTurns turns{TURN_BARRIER + group, TURN_BARRIER + (group ^ 1)};
    if (PINGPONG > 0 && group == 1) turn_arrive(TURN_BARRIER);  // warpgroup 0 goes first
    if constexpr (OVERLAP)
        attend_overlapped(pipe, o, row_max, row_sum, q_group_tile, p, b, row_first, group_first,
                          tiles, lane);
    else
        attend_serial(pipe, o, row_max, row_sum, q_group_tile, p, b, row_first, group_first,
                      tiles, lane, turns);
    if (PINGPONG > 0 && group == 0) turn_sync(TURN_BARRIER);  // warpgroup 1's last turn
    // The output goes out through the warp's own query rows, which the warpgroup's products
    // no longer read once all four warps are here.
    warpgroup_sync(group);
    finish_rows(o, row_max, row_sum, SwizzledQueryRows{q_tile, (warp & 3) * 16 + group * 64}, p,
                b, h, row_first, lane);
    if constexpr (CLUSTER > 1) cluster_sync();
}

}  // namespace wg

}  // namespace tc

}  // namespace

#endif

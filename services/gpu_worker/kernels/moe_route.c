/* A mixture of experts' routing (layers/moe.py SparseMoE.route on the C kernels' path, and
 * the one-call decode stack's MoE layers, decode_stack.c): softmax of each row's router
 * logits, its top-k experts, their weights renormalized where asked.
 *
 * The top-k is torch.topk's on the CPU, ties included: transformers routes with
 * `torch.topk(probs, k)`, which on the CPU (ATen/native/TopKImpl.h) puts (value, index) pairs
 * in index order and runs libstdc++'s std::partial_sort (k * 64 <= n) or std::nth_element
 * then std::sort of the first k - 1, comparing values alone. Among equal values the order
 * those algorithms leave is not the index order, and it is what transformers picks; so the
 * same algorithms are written out here, step for step as libstdc++ has them (bits/stl_algo.h,
 * bits/stl_heap.h: introselect with median-of-three pivots, insertion sort under 4 / 16
 * elements, heap select): the same experts whatever the ties (tests/unit/test_moe.py holds
 * it against torch.topk on rows full of ties).
 *
 * gpt-oss's router takes the top-k of the logits and the softmax of those k (kind 2).
 *
 * The softmax is float32 with its own exp (exp_poly.h: the same bits on every CPU class and
 * thread count): max, exp(l - max), their sum in index order, each times 1 / sum. A row's
 * routing depends on nothing but its logits.
 */
#include <stdint.h>

#include "exp_poly.h"

typedef struct {
    float v;
    int64_t i;
} Pair;

/* torch's comparator for largest: NaN first, then greater values */
static inline int before(const Pair *a, const Pair *b) {
    return (a->v != a->v && b->v == b->v) || a->v > b->v;
}

static inline void swap(Pair *a, Pair *b) {
    const Pair t = *a;
    *a = *b;
    *b = t;
}

static int64_t lg(int64_t n) {
    int64_t k = 0;
    while (n >>= 1) k++;
    return k;
}

/* std::__move_median_to_first */
static void median_to_first(Pair *result, Pair *a, Pair *b, Pair *c) {
    if (before(a, b)) {
        if (before(b, c)) swap(result, b);
        else if (before(a, c)) swap(result, c);
        else swap(result, a);
    } else if (before(a, c)) swap(result, a);
    else if (before(b, c)) swap(result, c);
    else swap(result, b);
}

/* std::__unguarded_partition */
static Pair *unguarded_partition(Pair *first, Pair *last, const Pair *pivot) {
    for (;;) {
        while (before(first, pivot)) ++first;
        --last;
        while (before(pivot, last)) --last;
        if (!(first < last)) return first;
        swap(first, last);
        ++first;
    }
}

/* std::__unguarded_partition_pivot */
static Pair *partition_pivot(Pair *first, Pair *last) {
    Pair *mid = first + (last - first) / 2;
    median_to_first(first, first + 1, mid, last - 1);
    return unguarded_partition(first + 1, last, first);
}

/* std::__unguarded_linear_insert */
static void linear_insert(Pair *last) {
    const Pair val = *last;
    Pair *next = last - 1;
    while (before(&val, next)) {
        *last = *next;
        last = next;
        --next;
    }
    *last = val;
}

/* std::__insertion_sort */
static void insertion_sort(Pair *first, Pair *last) {
    if (first == last) return;
    for (Pair *i = first + 1; i != last; ++i) {
        if (before(i, first)) {
            const Pair val = *i;
            for (Pair *p = i; p != first; --p) *p = *(p - 1);
            *first = val;
        } else {
            linear_insert(i);
        }
    }
}

/* std::__push_heap (holes by index from first) */
static void push_heap(Pair *first, int64_t hole, int64_t top, Pair value) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && before(first + parent, &value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

/* std::__adjust_heap */
static void adjust_heap(Pair *first, int64_t hole, int64_t len, Pair value) {
    const int64_t top = hole;
    int64_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(first + child, first + (child - 1))) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, value);
}

/* std::__make_heap */
static void make_heap(Pair *first, Pair *last) {
    const int64_t len = last - first;
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

/* std::__pop_heap */
static void pop_heap(Pair *first, Pair *last, Pair *result) {
    const Pair value = *result;
    *result = *first;
    adjust_heap(first, 0, last - first, value);
}

/* std::__heap_select */
static void heap_select(Pair *first, Pair *middle, Pair *last) {
    make_heap(first, middle);
    for (Pair *i = middle; i < last; ++i)
        if (before(i, first)) pop_heap(first, middle, i);
}

/* std::__sort_heap */
static void sort_heap(Pair *first, Pair *last) {
    while (last - first > 1) {
        --last;
        pop_heap(first, last, last);
    }
}

/* std::partial_sort */
static void partial_sort(Pair *first, Pair *middle, Pair *last) {
    heap_select(first, middle, last);
    sort_heap(first, middle);
}

/* std::__introsort_loop (threshold 16) */
static void introsort_loop(Pair *first, Pair *last, int64_t depth) {
    while (last - first > 16) {
        if (depth == 0) {
            partial_sort(first, last, last);
            return;
        }
        --depth;
        Pair *cut = partition_pivot(first, last);
        introsort_loop(cut, last, depth);
        last = cut;
    }
}

/* std::sort: introsort, then __final_insertion_sort */
static void sort(Pair *first, Pair *last) {
    if (first == last) return;
    introsort_loop(first, last, lg(last - first) * 2);
    if (last - first > 16) {
        insertion_sort(first, first + 16);
        for (Pair *i = first + 16; i != last; ++i) linear_insert(i);
    } else {
        insertion_sort(first, last);
    }
}

/* std::nth_element: __introselect */
static void nth_element(Pair *first, Pair *nth, Pair *last) {
    if (first == last || nth == last) return;
    int64_t depth = lg(last - first) * 2;
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(first, nth + 1, last);
            swap(first, nth);
            return;
        }
        --depth;
        Pair *cut = partition_pivot(first, last);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    insertion_sort(first, last);
}

#define MOE_MAX_EXPERTS 1024

/* softmax of v [n] in place: max, exp(v - max), their sum in order, each times 1 / sum */
__attribute__((optimize("fp-contract=off"))) static void softmax_pairs(Pair *v, int64_t n) {
    float mx = v[0].v, sum = 0.f;
    for (int64_t e = 1; e < n; e++) mx = v[e].v > mx ? v[e].v : mx;
    for (int64_t e = 0; e < n; e++) {
        v[e].v = exp_poly(v[e].v - mx);
        sum += v[e].v;
    }
    const float inv = 1.f / sum;
    for (int64_t e = 0; e < n; e++) v[e].v = v[e].v * inv;
}

/* torch.topk(v, k)'s first k pairs of v [n] (in index order on entry) */
static void top_k(Pair *v, int64_t n, int64_t k) {
    if (k * 64 <= n) {
        partial_sort(v, v + k, v + n);
    } else {
        nth_element(v, v + k - 1, v + n);
        sort(v, v + k - 1);
    }
}

/* logits [t, n] -> weights [t, k] and ids [t, k], in torch.topk's order. kind 0: the k
 * largest of the softmax (Qwen3-MoE); 1: those renormalized to sum to 1 (Mixtral,
 * norm_topk_prob); 2: the k largest logits, then the softmax of those k (gpt-oss's router).
 * Returns 0, or -1 for n, k or kind out of range (nothing written). */
__attribute__((optimize("fp-contract=off"))) int mstar_moe_route(const float *logits, int64_t t, int64_t n, int64_t k,
                                                                  int kind, float *weights, int64_t *ids) {
    Pair q[MOE_MAX_EXPERTS];
    if (n < 1 || n > MOE_MAX_EXPERTS || k < 1 || k > n || kind < 0 || kind > 2) return -1;
    for (int64_t r = 0; r < t; r++) {
        for (int64_t e = 0; e < n; e++) {
            q[e].v = logits[r * n + e];
            q[e].i = e;
        }
        if (kind == 2) {
            top_k(q, n, k);
            softmax_pairs(q, k);
        } else {
            softmax_pairs(q, n);
            top_k(q, n, k);
        }
        float *w = weights + r * k, picked = 0.f;
        for (int64_t j = 0; j < k; j++) {
            w[j] = q[j].v;
            ids[r * k + j] = q[j].i;
        }
        if (kind == 1) {
            for (int64_t j = 0; j < k; j++) picked += w[j];
            for (int64_t j = 0; j < k; j++) w[j] = w[j] / picked;
        }
    }
    return 0;
}

#include "thread_pool.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace kt {

static inline void cpu_relax() { __builtin_ia32_pause(); }

// How long an idle worker, or a caller waiting for the last items, spins before it sleeps on a condition variable.
// A decode step runs ~20 jobs with 0.1-0.5 ms of the caller's torch work between them; a worker asleep at the next
// launch costs a futex wake-up, and the job runs on the caller alone until the worker is back. Counted in time, not
// in pause instructions: a pause takes ~10 ns on some x86 cores and ~40 ns on others (4000 pauses were 38 us here,
// so the worker slept between nearly all jobs: DeepSeek-V3-shaped decode, 2 cores, step -1.2 to -2 ms with 0.4 ms).
// Only with the caller as worker 0: n - 1 spinning threads and the caller's torch work then fit n cores. With every
// worker a pinned thread (KT_POOL_CALLER=0) they would take the cores the caller needs between jobs (a 1 ms spin
// there: decode step 38 -> 70 ms), so those spin ~40 us, as before.
constexpr auto kSpinBudgetCaller = std::chrono::microseconds(1000);
constexpr auto kSpinBudgetThreads = std::chrono::microseconds(40);

// Spin while !done(), at most budget; -> done().
template <class Done>
static bool spin_until(Done done, std::chrono::microseconds budget) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 1;; ++i) {
        if (done()) return true;
        cpu_relax();
        if ((i & 63) == 0 && std::chrono::steady_clock::now() - t0 > budget) return done();
    }
}

void SpinBarrier::wait() {
    const unsigned gen = generation_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
        count_.store(0, std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_release);
        return;
    }
    for (int spin = 0; generation_.load(std::memory_order_acquire) == gen; ++spin) {
        if (spin < 2000) cpu_relax();
        else std::this_thread::yield();   // other processes share the cores: don't burn them
    }
}

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}
static std::vector<int> parse_cpulist(const std::string& s) {
    std::vector<int> cpus;
    std::stringstream ss(s);
    std::string part;
    while (std::getline(ss, part, ',')) {
        if (part.empty() || part == "\n") continue;
        int a = 0, b = 0;
        if (std::sscanf(part.c_str(), "%d-%d", &a, &b) == 2) for (int c = a; c <= b; ++c) cpus.push_back(c);
        else if (std::sscanf(part.c_str(), "%d", &a) == 1) cpus.push_back(a);
    }
    return cpus;
}

std::vector<std::vector<int>> numa_node_cpus() {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) CPU_SET(0, &allowed);
    std::vector<std::pair<int, std::vector<int>>> nodes;
    if (DIR* d = opendir("/sys/devices/system/node")) {
        while (dirent* e = readdir(d)) {
            int node = -1;
            if (std::sscanf(e->d_name, "node%d", &node) != 1) continue;
            std::ifstream f(std::string("/sys/devices/system/node/") + e->d_name + "/cpulist");
            std::string line;
            std::getline(f, line);
            std::vector<int> cpus;
            for (int c : parse_cpulist(line)) if (c < CPU_SETSIZE && CPU_ISSET(c, &allowed)) cpus.push_back(c);
            if (!cpus.empty()) nodes.emplace_back(node, cpus);
        }
        closedir(d);
    }
    std::sort(nodes.begin(), nodes.end());
    std::vector<std::vector<int>> out;
    for (auto& n : nodes) out.push_back(n.second);
    if (out.empty()) {   // no sysfs: one node with every allowed CPU
        std::vector<int> cpus;
        for (int c = 0; c < CPU_SETSIZE; ++c) if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
        out.push_back(cpus);
    }
    return out;
}

ThreadPool::ThreadPool(int n_threads, int n_pools) : n_pools_(n_pools) {
    if (n_pools < 1) throw std::runtime_error("number of thread sub-pools must be >= 1");
    if (n_threads < n_pools)
        throw std::runtime_error("n_threads (" + std::to_string(n_threads) + ") must be >= the number of sub-pools (" +
                                 std::to_string(n_pools) + ")");
    // CPUs of each sub-pool: the real NUMA nodes when there are enough, else all CPUs split into n_pools parts.
    std::vector<std::vector<int>> nodes = numa_node_cpus();
    std::vector<std::vector<int>> pool_cpus;
    if ((int)nodes.size() >= n_pools) {
        pool_cpus.assign(nodes.begin(), nodes.begin() + n_pools);
    } else {
        std::vector<int> all;
        for (auto& n : nodes) all.insert(all.end(), n.begin(), n.end());
        for (int p = 0; p < n_pools; ++p) {
            size_t a = all.size() * p / n_pools, b = all.size() * (p + 1) / n_pools;
            if (b == a) b = a + 1;   // more pools than CPUs: share
            std::vector<int> part;
            for (size_t i = a; i < b; ++i) part.push_back(all[i % all.size()]);
            pool_cpus.push_back(part);
        }
    }
    pool_barriers_.reset(new SpinBarrier[n_pools]);
    for (int p = 0; p < n_pools; ++p) {
        const int a = n_threads * p / n_pools, b = n_threads * (p + 1) / n_pools;
        pool_barriers_[p].init(b - a);
        for (int r = 0; r < b - a; ++r) {
            infos_.push_back(WorkerInfo{a + r, p, r, b - a, n_threads});
            cpus_.push_back(pool_cpus[p][r % pool_cpus[p].size()]);
        }
    }
    global_barrier_.init(n_threads);
    const char* env = std::getenv("KT_POOL_CALLER");
    caller_works_ = !(env && std::string(env) == "0");
    if (caller_works_) cpus_[0] = -1;   // the caller's thread: never pinned here
    for (int i = caller_works_ ? 1 : 0; i < n_threads; ++i) threads_.emplace_back(&ThreadPool::worker_main, this, i);
}

ThreadPool::~ThreadPool() {
    wait();
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_work_.notify_all();
    for (auto& t : threads_) t.join();
}

void ThreadPool::launch(std::function<void(const WorkerInfo&)> job) {
    wait();
    {
        std::lock_guard<std::mutex> lk(mu_);
        job_ = std::move(job);
        resting_.store(false, std::memory_order_relaxed);
        pending_.store(n_threads(), std::memory_order_relaxed);
        caller_share_.store(caller_works_, std::memory_order_release);
        generation_.fetch_add(1, std::memory_order_release);
    }
    if (!threads_.empty()) cv_work_.notify_all();
}

std::chrono::microseconds ThreadPool::spin_budget() const {
    return caller_works_ ? kSpinBudgetCaller : kSpinBudgetThreads;
}

void ThreadPool::finish_one() {
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(mu_);   // a waiter checks pending_ under mu_: no lost wake-up
        cv_done_.notify_all();
    }
}

void ThreadPool::wait() {
    if (caller_share_.load(std::memory_order_acquire) && caller_share_.exchange(false, std::memory_order_acq_rel)) {
        job_(infos_[0]);
        finish_one();
    }
    // The other workers' last items end about when the caller's do: spin before sleeping.
    if (spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; }, spin_budget())) return;
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
}

bool ThreadPool::busy() { return pending_.load(std::memory_order_acquire) != 0; }

void ThreadPool::rest() { resting_.store(true, std::memory_order_release); }

void ThreadPool::worker_main(int i) {
    if (cpus_[i] >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus_[i], &set);
        if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) cpus_[i] = -1;
    }
    uint64_t seen = 0;
    for (;;) {
        // A decode loop submits job after job: spin before sleeping to skip the wake-up latency.
        // rest() ends the spin at once: the caller has other work for the cores until its next launch
        spin_until([&] { return generation_.load(std::memory_order_acquire) != seen ||
                                resting_.load(std::memory_order_acquire); }, spin_budget());
        std::function<void(const WorkerInfo&)>* job;
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_work_.wait(lk, [&] { return stop_ || generation_.load() != seen; });
            if (stop_) return;
            seen = generation_.load();
            job = &job_;
        }
        (*job)(infos_[i]);
        finish_one();
    }
}

uint64_t next_rows_tag_base() {
    static std::atomic<uint64_t> serial{0};
    return (serial.fetch_add(1, std::memory_order_relaxed) + 1) << 24;
}

}  // namespace kt

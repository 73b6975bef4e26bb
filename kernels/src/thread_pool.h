// Persistent worker threads pinned to CPUs, grouped into sub-pools (one per NUMA node, or simulated).
// One job at a time: launch() returns at once, wait() blocks until every worker finished the job.
//
// Worker 0 is, by default, the thread that calls wait() (the one that submitted, in ktrun the Python thread): it runs
// its share of the job inside wait() instead of sleeping there, so a pool of n workers starts n-1 threads. A decode
// step submits a job and waits for it at once ~20 times; a sleeping caller paid a futex sleep and a wake-up per job
// and an extra runnable thread on the cores between jobs. It is not pinned (its CPU is its own business).
// KT_POOL_CALLER=0 (read at construction) makes every worker a pinned thread again: for callers that do other work
// between submit and sync (a GPU's launches), since the caller's share of a job then starts only in wait() and a
// job's barriers wait for it.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kt {

struct WorkerInfo {
    int index;       // 0 .. n_threads-1
    int pool;        // sub-pool (NUMA node) of this worker
    int rank;        // index inside the sub-pool
    int pool_size;   // workers in the sub-pool
    int n_threads;
};

// Sense-reversing barrier: spins briefly (the work between barriers is short), then yields the CPU.
class SpinBarrier {
public:
    void init(int n) { n_ = n; count_.store(0); generation_.store(0); }
    void wait();
private:
    int n_ = 1;
    std::atomic<int> count_{0};
    std::atomic<unsigned> generation_{0};
};

// CPUs per NUMA node read from /sys/devices/system/node, restricted to the CPUs this process may use.
std::vector<std::vector<int>> numa_node_cpus();

class ThreadPool {
public:
    // n_pools sub-pools; when the machine has fewer NUMA nodes than n_pools the CPUs are split (simulation).
    ThreadPool(int n_threads, int n_pools);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int n_threads() const { return (int)infos_.size(); }
    int n_pools() const { return n_pools_; }
    const WorkerInfo& info(int i) const { return infos_[i]; }
    int cpu_of(int i) const { return cpus_[i]; }

    void launch(std::function<void(const WorkerInfo&)> job);
    void wait();     // runs worker 0's share first when the caller is worker 0
    bool busy();
    void rest();     // idle workers sleep now instead of spinning (a pause with other work for the cores ahead)
    bool caller_works() const { return caller_works_; }
    void pool_barrier(int pool) { pool_barriers_[pool].wait(); }
    void global_barrier() { global_barrier_.wait(); }

private:
    void worker_main(int i);
    void finish_one();   // one worker's share of the job is done
    std::chrono::microseconds spin_budget() const;   // how long a waiting thread spins before it sleeps

    int n_pools_;
    std::vector<WorkerInfo> infos_;
    std::vector<int> cpus_;                          // pinned CPU per worker, -1 if pinning failed
    std::unique_ptr<SpinBarrier[]> pool_barriers_;
    SpinBarrier global_barrier_;
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_work_, cv_done_;
    std::function<void(const WorkerInfo&)> job_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};        // workers (the caller included) still running the job
    std::atomic<bool> caller_share_{false};   // worker 0's share of the job not taken yet (caller_works_)
    std::atomic<bool> resting_{false};        // rest(): idle workers sleep at once; the next launch clears it
    bool caller_works_ = true;
    bool stop_ = false;
};

// A base for ActRows::tag (kernel_types.h) unique in the process: each job of an engine takes one and names its
// row sets base + 1, base + 2, ... (below 2^24), so a kernel's per-thread copy of rows never outlives their job.
uint64_t next_rows_tag_base();

}  // namespace kt

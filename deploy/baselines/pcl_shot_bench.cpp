// PCL baseline for `scanforest bench shot --pcl-baseline BINARY`: NormalEstimationOMP (k nearest)
// then SHOTEstimationOMP on a scene, all valid points as keypoints, on a given thread count.
// scanforest does not depend on PCL; this is only the yardstick. Build (Debian 12, PCL 1.13):
//   apt-get install libpcl-dev
//   g++ -O2 -fopenmp -I/usr/include/pcl-1.13 -I/usr/include/eigen3 pcl_shot_bench.cpp -o pcl_shot_bench \
//       -lpcl_features -lpcl_io -lpcl_common -lpcl_search -lpcl_kdtree -lpcl_filters -lflann_cpp
// Prints one JSON line per repetition.
#include <pcl/io/pcd_io.h>
#include <pcl/point_types.h>
#include <pcl/filters/filter.h>
#include <pcl/features/normal_3d_omp.h>
#include <pcl/features/shot_omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  if (argc < 5) { std::fprintf(stderr, "usage: shot_bench scene.pcd radius k_normals threads [repeat]\n"); return 2; }
  float radius = std::atof(argv[2]); int k = std::atoi(argv[3]); int threads = std::atoi(argv[4]);
  int repeat = argc > 5 ? std::atoi(argv[5]) : 1;
  pcl::PointCloud<pcl::PointXYZ>::Ptr raw(new pcl::PointCloud<pcl::PointXYZ>), cloud(new pcl::PointCloud<pcl::PointXYZ>);
  if (pcl::io::loadPCDFile(argv[1], *raw) < 0) return 1;
  pcl::Indices idx; pcl::removeNaNFromPointCloud(*raw, *cloud, idx);
  for (int r = 0; r < repeat; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    pcl::NormalEstimationOMP<pcl::PointXYZ, pcl::Normal> ne(threads);
    pcl::PointCloud<pcl::Normal>::Ptr normals(new pcl::PointCloud<pcl::Normal>);
    ne.setInputCloud(cloud); ne.setKSearch(k); ne.compute(*normals);
    auto t1 = std::chrono::steady_clock::now();
    pcl::SHOTEstimationOMP<pcl::PointXYZ, pcl::Normal, pcl::SHOT352> se(threads);
    pcl::PointCloud<pcl::SHOT352> desc;
    se.setInputCloud(cloud); se.setInputNormals(normals); se.setRadiusSearch(radius); se.compute(desc);
    auto t2 = std::chrono::steady_clock::now();
    double tn = std::chrono::duration<double>(t1 - t0).count(), ts = std::chrono::duration<double>(t2 - t1).count();
    std::printf("{\"points\": %zu, \"threads\": %d, \"normals_s\": %.4f, \"shot_s\": %.4f, \"total_s\": %.4f, \"keypoints_per_s\": %.1f}\n",
                cloud->size(), threads, tn, ts, tn + ts, cloud->size() / (tn + ts));
  }
  return 0;
}

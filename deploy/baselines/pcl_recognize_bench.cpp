// PCL baseline for `scanforest bench recognize --pcl-baseline BINARY`: PCL's correspondence-grouping
// tutorial (https://pcl.readthedocs.io/projects/tutorials/en/latest/correspondence_grouping.html)
// with its default parameters (model sampling 0.01, scene sampling 0.03, frame radius 0.015,
// descriptor radius 0.02, Hough bin 0.01, threshold 5), timed from the loaded clouds to the poses
// (normals, uniform sampling, SHOT, k-d tree matching, BOARD frames, Hough 3-D grouping).
// scanforest does not depend on PCL; this is only the yardstick. Build (Debian 12, PCL 1.13):
//   apt-get install libpcl-dev
//   g++ -O2 -fopenmp -I/usr/include/pcl-1.13 -I/usr/include/eigen3 pcl_recognize_bench.cpp \
//       -o pcl_recognize_bench -lpcl_features -lpcl_io -lpcl_common -lpcl_search -lpcl_kdtree \
//       -lpcl_filters -lpcl_recognition -lflann_cpp -llz4
// Usage: pcl_recognize_bench model.pcd scene.pcd threads [repeat]. One JSON line per repetition.
#include <pcl/io/pcd_io.h>
#include <pcl/point_types.h>
#include <pcl/correspondence.h>
#include <pcl/features/normal_3d_omp.h>
#include <pcl/features/shot_omp.h>
#include <pcl/features/board.h>
#include <pcl/filters/uniform_sampling.h>
#include <pcl/recognition/cg/hough_3d.h>
#include <pcl/kdtree/kdtree_flann.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

typedef pcl::PointXYZRGBA PointType;
typedef pcl::PointCloud<PointType> Cloud;
using Clock = std::chrono::steady_clock;
static double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

int main(int argc, char** argv) {
  if (argc < 4) { std::fprintf(stderr, "usage: pcl_recognize_bench model.pcd scene.pcd threads [repeat]\n"); return 2; }
  const int threads = std::atoi(argv[3]), repeat = argc > 4 ? std::atoi(argv[4]) : 1;
  const float model_ss = 0.01f, scene_ss = 0.03f, rf_rad = 0.015f, descr_rad = 0.02f, cg_size = 0.01f, cg_thresh = 5.0f;
  Cloud::Ptr model(new Cloud), scene(new Cloud);
  if (pcl::io::loadPCDFile(argv[1], *model) < 0 || pcl::io::loadPCDFile(argv[2], *scene) < 0) return 1;
  for (int r = 0; r < repeat; ++r) {
    auto t0 = Clock::now();
    pcl::PointCloud<pcl::Normal>::Ptr mn(new pcl::PointCloud<pcl::Normal>), sn(new pcl::PointCloud<pcl::Normal>);
    pcl::NormalEstimationOMP<PointType, pcl::Normal> ne(threads);
    ne.setKSearch(10);
    ne.setInputCloud(model); ne.compute(*mn);
    ne.setInputCloud(scene); ne.compute(*sn);
    auto t1 = Clock::now();
    Cloud::Ptr mk(new Cloud), sk(new Cloud);
    pcl::UniformSampling<PointType> us;
    us.setInputCloud(model); us.setRadiusSearch(model_ss); us.filter(*mk);
    us.setInputCloud(scene); us.setRadiusSearch(scene_ss); us.filter(*sk);
    auto t2 = Clock::now();
    pcl::PointCloud<pcl::SHOT352>::Ptr md(new pcl::PointCloud<pcl::SHOT352>), sd(new pcl::PointCloud<pcl::SHOT352>);
    pcl::SHOTEstimationOMP<PointType, pcl::Normal, pcl::SHOT352> de(threads);
    de.setRadiusSearch(descr_rad);
    de.setInputCloud(mk); de.setInputNormals(mn); de.setSearchSurface(model); de.compute(*md);
    de.setInputCloud(sk); de.setInputNormals(sn); de.setSearchSurface(scene); de.compute(*sd);
    auto t3 = Clock::now();
    pcl::CorrespondencesPtr corrs(new pcl::Correspondences);
    pcl::KdTreeFLANN<pcl::SHOT352> match;
    match.setInputCloud(md);
    for (std::size_t i = 0; i < sd->size(); ++i) {
      std::vector<int> idx(1); std::vector<float> d2(1);
      if (!std::isfinite(sd->at(i).descriptor[0])) continue;
      if (match.nearestKSearch(sd->at(i), 1, idx, d2) == 1 && d2[0] < 0.25f) corrs->push_back(pcl::Correspondence(idx[0], static_cast<int>(i), d2[0]));
    }
    auto t4 = Clock::now();
    pcl::PointCloud<pcl::ReferenceFrame>::Ptr mrf(new pcl::PointCloud<pcl::ReferenceFrame>), srf(new pcl::PointCloud<pcl::ReferenceFrame>);
    pcl::BOARDLocalReferenceFrameEstimation<PointType, pcl::Normal, pcl::ReferenceFrame> rf;
    rf.setFindHoles(true); rf.setRadiusSearch(rf_rad);
    rf.setInputCloud(mk); rf.setInputNormals(mn); rf.setSearchSurface(model); rf.compute(*mrf);
    rf.setInputCloud(sk); rf.setInputNormals(sn); rf.setSearchSurface(scene); rf.compute(*srf);
    pcl::Hough3DGrouping<PointType, PointType, pcl::ReferenceFrame, pcl::ReferenceFrame> cg;
    cg.setHoughBinSize(cg_size); cg.setHoughThreshold(cg_thresh); cg.setUseInterpolation(true); cg.setUseDistanceWeight(false);
    cg.setInputCloud(mk); cg.setInputRf(mrf); cg.setSceneCloud(sk); cg.setSceneRf(srf); cg.setModelSceneCorrespondences(corrs);
    std::vector<Eigen::Matrix4f, Eigen::aligned_allocator<Eigen::Matrix4f>> poses;
    std::vector<pcl::Correspondences> groups;
    cg.recognize(poses, groups);
    auto t5 = Clock::now();
    std::string ps = "[";
    for (std::size_t i = 0; i < poses.size(); ++i) {
      ps += (i ? ", [" : "[");
      for (int a = 0; a < 16; ++a) { char b[32]; std::snprintf(b, sizeof b, "%s%.6f", a ? ", " : "", poses[i](a / 4, a % 4)); ps += b; }
      ps += "]";
    }
    ps += "]";
    std::printf("{\"threads\": %d, \"model_points\": %zu, \"scene_points\": %zu, \"model_keypoints\": %zu, \"scene_keypoints\": %zu, "
                "\"correspondences\": %zu, \"instances\": %zu, \"normals_s\": %.4f, \"sampling_s\": %.4f, \"shot_s\": %.4f, "
                "\"matching_s\": %.4f, \"grouping_s\": %.4f, \"total_s\": %.4f, \"group_sizes\": [",
                threads, model->size(), scene->size(), mk->size(), sk->size(), corrs->size(), poses.size(),
                secs(t0, t1), secs(t1, t2), secs(t2, t3), secs(t3, t4), secs(t4, t5), secs(t0, t5));
    for (std::size_t i = 0; i < groups.size(); ++i) std::printf("%s%zu", i ? ", " : "", groups[i].size());
    std::printf("], \"poses\": %s}\n", ps.c_str());
  }
  return 0;
}

"""instance"""
